"""The worker's port: the edge as the batch runner needs it. Small and all-async.

The runner is written against this protocol only, so it is unit-tested with a
fake edge and knows nothing of frames, envelopes or correlation ids.
"""

from __future__ import annotations

from typing import Protocol

from iop_worker.domain.batches import Lease, LineResult


class EdgePort(Protocol):
    """Lease, renew, run a line, release: one registered connection to the edge.

    Every call raises ``EdgeLinkLost`` once the connection is gone (all calls in
    flight fail together), ``TimeoutError`` when the edge does not answer in
    time, and ``EdgeRefused`` when it answers with an ``error`` frame.
    """

    async def lease(self) -> Lease | None:
        """A batch to run, or ``None`` when the edge has nothing to do now."""
        ...

    async def renew(self, lease: Lease) -> None:
        """Extend the lease; raises ``LeaseLost`` when the edge no longer honours it."""
        ...

    async def run_line(self, lease: Lease, line_number: int) -> LineResult:
        """Have the edge execute and store one line; raises ``LeaseLost`` like ``renew``."""
        ...

    async def release(self, lease: Lease, *, finished: bool) -> None:
        """Give the lease back; ``finished`` asks the edge to finalize the batch.

        Sending is the whole call: the edge may acknowledge it or not.
        """
        ...
