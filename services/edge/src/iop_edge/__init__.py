"""IOP edge: the public OpenAI-compatible API, model pools, selection and queues.

Nodes and workers dial the edge; the edge dials the control-plane.
"""

__version__ = "0.1.0"
