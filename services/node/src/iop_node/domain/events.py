"""The events of one run, as the executor emits them to its ``RunChannel`` (``ports``).

Plain values; the edge link turns each into its ``pb.RunEvent`` at the rim
(``entrypoints/wire.py``). A run emits ``Started``, then ``Delta`` s (streamed runs),
then exactly one of ``Completion`` or ``Failed``; the link adds the acknowledgement.
"""

from __future__ import annotations

from iop_node.domain.record import record
from iop_node.domain.runs import Completion, Delta
from iop_node.errors import ErrorCode


@record
class Started:
    """The run has its slot and its provider is being called."""

    provider_id: str
    target: str
    queue_wait_ms: int


@record
class Failed:
    """How a run ended without a result (the terminal event of every failure)."""

    code: ErrorCode
    message: str
    provider_status: int = 0
    provider_us: int = 0  # the wait on the provider before it failed
    context_window: int = 0  # a context overflow's numbers (0: not one, or not said)
    prompt_tokens: int = 0


RunEvent = Started | Delta | Completion | Failed
"""Every event a run emits."""
