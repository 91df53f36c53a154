"""What a run is sent on and how long the edge waits for its node (``RequestRun``'s guards).

The guards themselves are judged by the run (``service/request_run.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from iop_edge.domain.events import RunOrder


@dataclass(frozen=True, slots=True)
class RunGuards:
    """How long the edge waits for a node's acknowledgement and, in a stream, for the
    first delta and then between events, before it fails the run itself (0: not
    guarded; the settings' ``run_ack_timeout_s``, ``stall_timeout_s`` and
    ``first_token_timeout_s``)."""

    ack_timeout_s: float = 0.0
    stall_timeout_s: float = 0.0
    first_token_timeout_s: float = 0.0


UNGUARDED = RunGuards()
"""Only the deadline is guarded (the default of tests and tools that build runs)."""


class NodeLink(Protocol):
    """A registered node's connection, as dispatch uses it."""

    node_id: str
    acknowledges_runs: bool
    """The node sends ``Accepted`` for each run it takes (it said so when it registered)."""

    async def send_run(self, order: RunOrder) -> None:
        """Send ``order``; returns once it is on its way (the node's acknowledgement is
        timed from then, not from the time its edge takes to write a large one)."""
        ...

    async def send_cancel(self, run_id: str, reason: str) -> None: ...
