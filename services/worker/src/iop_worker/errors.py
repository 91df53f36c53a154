"""The worker's exception hierarchy: one root, the expected failures of the edge link below it.

The batch runner tells these apart because each has its own recovery: a lost
link ends the batch at once (the lease expires), a lost lease stops new lines,
a refused request is logged and retried later.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Root of every error the worker raises on purpose."""


class EdgeLinkLost(WorkerError, ConnectionError):
    """The connection to the edge is gone; every request in flight on it fails with this."""


class EdgeRefused(WorkerError):
    """The edge answered a request with an ``error`` frame instead of the expected answer.

    ``code`` is the protocol error code (an ``iop.v1.ErrorCode`` value).
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LeaseLost(EdgeRefused):
    """The edge no longer honours our lease: the batch was cancelled, expired or taken over."""
