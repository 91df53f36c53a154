"""Usage per key against its limits: what ``GET /iop/v1/usage``, the console's usage view
and ``iopctl usage`` show (docs/ARCHITECTURE.md#usage-per-key).

The numbers come from the run log (``RunLog.usage``), so they are every edge's when the
edges share PostgreSQL, and they count every run a key made: HTTP requests of each API
and batch lines. The windows are the ones the limits are stated in: the trailing
minute (the per-minute rates), the UTC day, and the key's budget period (a calendar
day, week or month, UTC). ``in_flight`` is this edge's count of the key's requests in
progress (``KeySlots``), beside ``max_concurrent``. A limit of 0 is no limit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from iop_edge.domain.fleet import ApiKeyEntry, BudgetPeriod, KeyLimits
from iop_edge.domain.usage import Counts, UsageRow, WindowUsage, period_start_ms, window_usage
from iop_edge.errors import NotFound
from iop_edge.ports import FleetView, RunLog

Window = BudgetPeriod | None
"""A window: a calendar period of the budgets, or ``None`` for the trailing minute."""


class UsageReport:
    """Each key's usage in its limits' windows, as JSON-ready views."""

    def __init__(
        self,
        fleet: FleetView,
        runlog: RunLog,
        in_flight: Callable[[str], int],
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``in_flight(key_id)``: the key's requests in progress on this edge."""
        self._fleet = fleet
        self._runlog = runlog
        self._in_flight = in_flight
        self._clock = clock

    async def views(self, caller: ApiKeyEntry | None, asked: str | None = None) -> dict[str, Any]:
        """The usage of the keys ``caller`` may see: an operator key (and the open API)
        every key, any other key its own only; ``asked`` (a key id or name) narrows it to
        one. A key asking for another is told it does not exist, as for files."""
        fleet_keys = sorted(self._fleet.current.api_keys.values(), key=_by_name)
        if caller is not None and not caller.operator:
            if asked is not None and asked not in (caller.key_id, caller.name):
                raise _no_such_key(asked)
            shown, scope = [caller], caller.key_id
        elif asked is not None:
            found = [k for k in fleet_keys if asked in (k.key_id, k.name)]
            shown, scope = found[:1], found[0].key_id if found else asked
        else:
            shown, scope = fleet_keys, None
        now_ms = int(self._clock() * 1000)
        windows: set[Window] = {None, BudgetPeriod.DAY}
        for key in shown:
            windows.add(key.limits.budget_period)
            windows.update(limits.budget_period for limits in key.model_limits.values())
        rows: dict[Window, list[UsageRow]] = {}
        for window in sorted(windows, key=_window_order):
            rows[window] = await self._runlog.usage(period_start_ms(window, now_ms), scope)
        known = {key.key_id for key in shown}
        # Keys no longer in the fleet (revoked), and runs of the open API (""), when seen.
        others = sorted({r.key_id for rs in rows.values() for r in rs} - known)
        if scope is not None and not shown:
            if scope not in others:
                raise _no_such_key(scope)
            others = [scope]
        data = [self._view(key.key_id, key, rows, now_ms) for key in shown]
        data.extend(self._view(key_id, None, rows, now_ms) for key_id in others)
        return {"now_ms": now_ms, "data": data}

    def _view(
        self,
        key_id: str,
        key: ApiKeyEntry | None,
        rows: dict[Window, list[UsageRow]],
        now_ms: int,
    ) -> dict[str, Any]:
        period = key.limits.budget_period if key is not None else BudgetPeriod.DAY
        used = {window: window_usage(found, key_id) for window, found in rows.items()}
        view: dict[str, Any] = {
            "key_id": key_id,
            "name": key.name if key is not None else "",
            "in_fleet": key is not None,
            "operator": key is not None and key.operator,
            "in_flight": self._in_flight(key_id),
            "max_concurrent": key.max_concurrent if key is not None else 0,
            "limits": _limits(key.limits) if key is not None else None,
            "minute": _window(used[None], period_start_ms(None, now_ms)),
            "day": _window(used[BudgetPeriod.DAY], period_start_ms(BudgetPeriod.DAY, now_ms)),
            "period": {
                "period": period.value,
                **_window(used[period], period_start_ms(period, now_ms)),
            },
            "models": [],
        }
        if key is not None:
            view["models"] = [
                {
                    "model": model,
                    "limits": _limits(limits),
                    "minute": _counts(used[None].by_model.get(model, Counts())),
                    "period": {
                        "period": limits.budget_period.value,
                        **_counts(used[limits.budget_period].by_model.get(model, Counts())),
                    },
                }
                for model, limits in sorted(key.model_limits.items())
            ]
        return view


def _window_order(window: Window) -> int:
    return -1 if window is None else list(BudgetPeriod).index(window)


def _no_such_key(asked: str) -> NotFound:
    return NotFound(f"No API key '{asked}'.", param="key")


def _counts(counts: Counts) -> dict[str, int]:
    return {**dataclasses.asdict(counts), "tokens": counts.tokens}


def _split(by: dict[str, Counts]) -> dict[str, dict[str, int]]:
    return {name: _counts(counts) for name, counts in sorted(by.items())}


def _window(used: WindowUsage, since_ms: int) -> dict[str, Any]:
    return {
        "since_ms": since_ms,
        **_counts(used.total),
        "by_api": _split(used.by_api),
        "by_model": _split(used.by_model),
    }


def _limits(limits: KeyLimits) -> dict[str, Any]:
    """The limits as the fleet has them; 0 in a field is no limit of that kind."""
    view = dataclasses.asdict(limits)
    view["budget_period"] = limits.budget_period.value
    return view


def _by_name(key: ApiKeyEntry) -> tuple[str, str]:
    return key.name, key.key_id
