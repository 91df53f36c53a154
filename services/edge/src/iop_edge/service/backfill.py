"""Batch lines as backfill: the share of a model's slots batch lines may hold at once,
and which batch line yields its slot to an interactive request
(docs/ARCHITECTURE.md#fair-queueing).

Batch lines wait in the lowest class of the model's queue (``ModelQueue``): every
interactive waiter is served first. On top of that they may hold at most
``max_share`` of the model's slots (its usable providers' capacity together, at
least one slot, so a batch always progresses on an idle pool): the rest stays free
for interactive requests that arrive, which then start at once instead of waiting
for a batch line to end.

Preemption (``preempt``): an interactive request that finds no free slot while batch
lines of its model hold some ends the newest of them (the least work lost). The line's
run is cancelled with ``Preempted``; its runner puts the line back in the queue
(``LineRunner``), nothing of the cancelled run was stored (a line's result is stored
once, by ``BatchStore.finish_line``, and only from a run that completed), so the line
is neither lost nor done twice. A run that completed before the cancel reached it is
not cancelled any more (``RequestRun.cancel`` after the end does nothing): its result
stands.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from iop_edge.domain.pool import ProviderSlot
from iop_edge.domain.queue import DEFAULT_MAX_SHARE
from iop_edge.service.request_run import RequestRun


class Backfill:
    """Which batch runs hold a slot of each model, against the share they may hold."""

    def __init__(self, max_share: float = DEFAULT_MAX_SHARE, *, preempt: bool = True) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.max_share = max_share
        self.preempt = preempt
        self._held: dict[str, dict[RequestRun, None]] = {}  # by model, oldest first
        self._yielding: set[RequestRun] = set()  # preempted, their slot not back yet

    def cap(self, members: Iterable[ProviderSlot]) -> int:
        """The most slots of a model batch lines may hold: ``max_share`` of its usable
        capacity, rounded down, at least one."""
        capacity = sum(slot.capacity for slot in members if slot.usable)
        return max(1, math.floor(capacity * self.max_share + 1e-9))

    def room(self, model_id: str, members: Iterable[ProviderSlot]) -> bool:
        """A batch line of the model may take a slot now."""
        held = self._held.get(model_id)
        return held is None or len(held) < self.cap(members)

    def took(self, run: RequestRun) -> None:
        self._held.setdefault(run.model.id, {})[run] = None

    def gave_back(self, run: RequestRun) -> None:
        self._yielding.discard(run)
        held = self._held.get(run.model.id)
        if held is not None:
            held.pop(run, None)
            if not held:
                del self._held[run.model.id]

    def victim(self, model_id: str, waiting: int) -> RequestRun | None:
        """The batch run of the model to preempt for ``waiting`` interactive waiters: the
        newest one holding a slot with an attempt on a node; ``None`` when preemption is
        off, or the runs already yielding cover the waiters."""
        if not self.preempt:
            return None
        held = self._held.get(model_id)
        if not held:
            return None
        yielding = sum(1 for run in held if run in self._yielding)
        if yielding >= waiting:
            return None
        for run in reversed(held):
            if run not in self._yielding and not run.ended and run.link is not None:
                self._yielding.add(run)
                return run
        return None
