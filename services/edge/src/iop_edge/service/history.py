"""The fleet's recent history as time series: what ``GET /iop/v1/history`` and the
console's plots show (docs/ARCHITECTURE.md#console-history).

From the run log (``RunLog.history``), so on PostgreSQL it is every edge's. The range
defaults to the trailing ``DEFAULT_RANGE_MS`` in ``DEFAULT_STEP_MS`` buckets, ending
now, its start on a multiple of the step so that the console's plots do not shift as it
polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from iop_edge.domain.history import MIN_STEP_MS, HistoryRange, HistoryRangeError, series
from iop_edge.ports import RunLog

DEFAULT_RANGE_MS: Final = 15 * 60_000
DEFAULT_STEP_MS: Final = 10_000


class HistoryReport:
    """Series per model and provider over a range of the run log, JSON-ready."""

    def __init__(self, runlog: RunLog, clock: Callable[[], float] = time.time) -> None:
        self._runlog = runlog
        self._clock = clock

    def span(self, since_ms: int | None, until_ms: int | None, step_ms: int | None) -> HistoryRange:
        """The range asked for, its missing ends the defaults' (``HistoryRangeError``
        when it cannot be answered)."""
        step = step_ms if step_ms is not None else DEFAULT_STEP_MS
        if step < MIN_STEP_MS:  # before the default range is laid on it (a 0 divides)
            raise HistoryRangeError(f"'step_ms' must be at least {MIN_STEP_MS}.", "step_ms")
        until = until_ms if until_ms is not None else int(self._clock() * 1000) + 1
        if since_ms is None:
            # On a multiple of the step, the buckets stay in place from one poll to the
            # next (only the last one grows); the range is then the default, give or
            # take the part of a step already gone.
            aligned = (until - 1) // step * step
            since_ms = aligned - max(DEFAULT_RANGE_MS - step, 0)
        return HistoryRange(since_ms, until, step)

    async def view(self, span: HistoryRange) -> dict[str, Any]:
        rows = await self._runlog.history(span)
        return {
            "since_ms": span.since_ms,
            "until_ms": span.until_ms,
            "step_ms": span.step_ms,
            "buckets": span.buckets,
            "data": series(rows, span),
        }
