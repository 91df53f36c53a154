"""A key's rates and budget as arithmetic: sliding minutes of one-second slots, and a
count per calendar period.

Pure: no clock (``now`` is Unix seconds, the store's), no I/O. The in-memory limiter and
the PostgreSQL one apply these same functions to the counts they keep, so one edge and
several edges follow one rule (docs/ARCHITECTURE.md#limits-per-key).

Rates hold over any minute: what a key used is counted per second, and a request is
admitted while the last 60 seconds' count leaves room for it (one request; its
estimated input tokens, at most the limit itself, so a prompt larger than a minute's
limit waits for an empty minute instead of never passing; some output tokens: they
are counted as they stream). A stream longer than what was left still finishes: the
minute's count then passes the limit and the key waits until it has slid below.
A token bucket would let twice the limit through in a minute (a full bucket, then its
refill); a fixed minute would too, across the minute's edge. The budget is a count of
input + output tokens per calendar period (UTC day, ISO week from Monday, month): a
request is admitted while it is below the budget, so the budget is passed by at most
what the requests in progress use.

The counts are a mapping ``(scope, kind, slot) -> amount``: ``scope`` is ``""`` for the
key's own limits or a model id for its per-model ones; ``kind`` one of ``REQUESTS``,
``INPUT``, ``OUTPUT`` (``slot``: the Unix second) or ``BUDGET`` (``slot``: the period's
start). Everything changes by adding amounts (``Counts``), which a shared store can do
without reading first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from iop_edge.domain.fleet import BudgetPeriod, KeyLimits

WINDOW_S: Final = 60
REQUESTS: Final = "requests"
INPUT: Final = "input_tokens"
OUTPUT: Final = "output_tokens"
BUDGET: Final = "budget"
RATES: Final = (REQUESTS, INPUT, OUTPUT)

Counts = Mapping[tuple[str, str, int], float]
Scopes = Sequence[tuple[str, KeyLimits]]  # ("", the key's), (model, the key's on it)


@dataclass(frozen=True, slots=True)
class Gauge:
    """One limit as the answer's headers show it: ``reset_s`` until nothing counted is
    left in the minute (for ``BUDGET``: until the period ends)."""

    kind: str
    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not admitted, and when it would be (``retry_after_s``)."""

    kind: str
    scope: str
    limit: int
    retry_after_s: float


def period_bounds(period: BudgetPeriod, now: float) -> tuple[int, int]:
    """The calendar period (UTC) holding ``now``: its start and end, Unix seconds."""
    moment = datetime.fromtimestamp(now, UTC)
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period is BudgetPeriod.DAY:
        start, end = day, day + timedelta(days=1)
    elif period is BudgetPeriod.WEEK:
        start = day - timedelta(days=day.weekday())  # ISO weeks start on Monday
        end = start + timedelta(days=7)
    else:
        start = day.replace(day=1)
        end = (start + timedelta(days=32)).replace(day=1)
    return int(start.timestamp()), int(end.timestamp())


def limit_of(limits: KeyLimits, kind: str) -> int:
    if kind == REQUESTS:
        return limits.requests_per_minute
    if kind == INPUT:
        return limits.input_tokens_per_minute
    if kind == OUTPUT:
        return limits.output_tokens_per_minute
    return limits.token_budget


def _slots(counts: Counts, scope: str, kind: str, now: float) -> list[tuple[int, float]]:
    """The minute's slots of one rate, oldest first: this second and the 60 before it.

    A count made during second ``s`` is held until ``s + 61``: between 60 and 61 s after
    it was made, never less, so no 60 seconds ever hold more than the limit (counting
    only the 59 whole seconds before this one would let a burst at the end of a second
    and another 59.01 s later both through)."""
    oldest = math.floor(now) - WINDOW_S
    return sorted(
        (slot, amount)
        for (s, k, slot), amount in counts.items()
        if s == scope and k == kind and slot >= oldest
    )


def _leaves(slot: int, now: float) -> float:
    """Seconds until a slot's count leaves the minute."""
    return max(0.0, slot + WINDOW_S + 1 - now)


def _wait(slots: list[tuple[int, float]], over: float, now: float) -> float:
    """Seconds until the slots that leave the minute first free ``over``."""
    freed = 0.0
    for slot, amount in slots:
        freed += amount
        if freed >= over:
            return _leaves(slot, now)
    return float(WINDOW_S + 1)


def admit(
    counts: Counts, scopes: Scopes, input_tokens: int, now: float
) -> tuple[Counts, Refusal | None]:
    """The amounts an admitted request adds, or the refusal (and nothing added).

    Refused on one limit, a request takes nothing. When several refuse, the one to
    wait longest for is said.
    """
    second = math.floor(now)
    adds: dict[tuple[str, str, int], float] = {}
    refusals: list[Refusal] = []
    for scope, limits in scopes:
        for kind, cost in ((REQUESTS, 1), (INPUT, input_tokens), (OUTPUT, 0)):
            limit = limit_of(limits, kind)
            if not limit:
                continue
            slots = _slots(counts, scope, kind, now)
            used = sum(amount for _, amount in slots)
            need = max(1, min(cost, limit))
            if used + need > limit:
                wait = _wait(slots, used + need - limit, now)
                refusals.append(Refusal(kind, scope, limit, wait))
            elif cost:
                adds[scope, kind, second] = float(cost)
        if limits.token_budget:
            start, end = period_bounds(limits.budget_period, now)
            used = counts.get((scope, BUDGET, start), 0.0)
            if used >= limits.token_budget:
                refusals.append(Refusal(BUDGET, scope, limits.token_budget, end - now))
            elif input_tokens:
                adds[scope, BUDGET, start] = float(input_tokens)
    if refusals:
        return {}, max(refusals, key=lambda refusal: refusal.retry_after_s)
    return adds, None


def charge(scopes: Scopes, input_tokens: int, output_tokens: int, now: float) -> Counts:
    """The amounts to add when a request used ``input_tokens`` more (fewer, when
    negative: the estimate corrected) and ``output_tokens`` more than was counted."""
    second = math.floor(now)
    adds: dict[tuple[str, str, int], float] = {}
    for scope, limits in scopes:
        for kind, cost in ((INPUT, input_tokens), (OUTPUT, output_tokens)):
            if cost and limit_of(limits, kind):
                adds[scope, kind, second] = float(cost)
        if limits.token_budget and (input_tokens or output_tokens):
            start, _ = period_bounds(limits.budget_period, now)
            adds[scope, BUDGET, start] = float(input_tokens + output_tokens)
    return adds


def gauges(counts: Counts, scopes: Scopes, now: float) -> tuple[Gauge, ...]:
    """Each limited kind's standing, for the answer's headers: of a kind limited on the
    key and on the model, the one with less left (it is the one that refuses first)."""
    shown: dict[str, Gauge] = {}
    for scope, limits in scopes:
        for kind in RATES:
            limit = limit_of(limits, kind)
            if not limit:
                continue
            slots = _slots(counts, scope, kind, now)
            used = sum(amount for _, amount in slots)
            reset = _leaves(slots[-1][0], now) if slots else 0.0
            _keep(shown, Gauge(kind, limit, max(0, math.floor(limit - used)), reset))
        if limits.token_budget:
            start, end = period_bounds(limits.budget_period, now)
            used = counts.get((scope, BUDGET, start), 0.0)
            left = max(0, math.floor(limits.token_budget - used))
            _keep(shown, Gauge(BUDGET, limits.token_budget, left, end - now))
    return tuple(shown.values())


OLDEST_PERIOD_S: Final = 32 * 86400
"""A budget's count is kept this long after its period started (past a month's end)."""


def expired(slot_key: tuple[str, str, int], now: float) -> bool:
    """Whether a count has left every window it could be asked about: a rate's slot
    past the minute, a budget's period over (a month ago at the latest)."""
    _, kind, slot = slot_key
    if kind == BUDGET:
        return slot < now - OLDEST_PERIOD_S
    return slot < math.floor(now) - WINDOW_S


def _keep(shown: dict[str, Gauge], gauge: Gauge) -> None:
    held = shown.get(gauge.kind)
    if held is None or gauge.remaining < held.remaining:
        shown[gauge.kind] = gauge


def scopes_of(limits: KeyLimits, model_limits: Mapping[str, KeyLimits], model: str) -> Scopes:
    """The scopes a request on ``model`` is held to: the key's, and the key's on the model."""
    scopes: list[tuple[str, KeyLimits]] = []
    if _rated(limits):
        scopes.append(("", limits))
    per_model = model_limits.get(model)
    if per_model is not None and _rated(per_model):
        scopes.append((model, per_model))
    return scopes


def _rated(limits: KeyLimits) -> bool:
    return any(limit_of(limits, kind) for kind in (*RATES, BUDGET))
