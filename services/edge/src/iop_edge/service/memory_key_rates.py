"""``KeyRateStore`` in this edge's memory: exact for one edge (SQLite deployments), and
the shared store's fallback while PostgreSQL cannot be reached.

Everything runs on the event loop without awaiting, so an admission's read, decision
and write are one step: no two requests of a key interleave inside one. No I/O, so it
lives beside the service (as ``KeySlots``' own count does) and the HTTP app can make
one by default.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from iop_edge.domain import key_rates
from iop_edge.domain.fleet import KeyLimits
from iop_edge.domain.key_rates import Counts, Gauge, Refusal, Scopes


class MemoryKeyRates:
    """Each key's counts in a dict, its expired slots dropped when it is next asked.

    ``share``: how many edges count the same keys on their own (1: this one alone); the
    limits are divided by it, so edges cut off from their shared store together still
    hold a key near its limit (the fallback of ``PostgresKeyRates``).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        share: Callable[[], int] = lambda: 1,
    ) -> None:
        self._clock = clock
        self._share = share
        self._counts: dict[str, dict[tuple[str, str, int], float]] = {}

    async def admit(
        self, key_id: str, scopes: Scopes, input_tokens: int
    ) -> tuple[tuple[Gauge, ...], Refusal | None]:
        now = self._clock()
        scopes = self._shared(scopes)
        counts = self._counts.setdefault(key_id, {})
        for slot in [slot for slot in counts if key_rates.expired(slot, now)]:
            del counts[slot]
        adds, refusal = key_rates.admit(counts, scopes, input_tokens, now)
        _add(counts, adds)
        return key_rates.gauges(counts, scopes, now), refusal

    def charge(self, key_id: str, scopes: Scopes, input_tokens: int, output_tokens: int) -> None:
        adds = key_rates.charge(self._shared(scopes), input_tokens, output_tokens, self._clock())
        _add(self._counts.setdefault(key_id, {}), adds)

    def _shared(self, scopes: Scopes) -> Scopes:
        edges = self._share()
        if edges <= 1:
            return scopes
        return [(scope, _divided(limits, edges)) for scope, limits in scopes]


def _add(counts: dict[tuple[str, str, int], float], adds: Counts) -> None:
    for slot, amount in adds.items():
        counts[slot] = counts.get(slot, 0.0) + amount


def _divided(limits: KeyLimits, edges: int) -> KeyLimits:
    """This edge's share of ``limits`` (at least 1 of each limit set)."""

    def part(value: int) -> int:
        return max(1, value // edges) if value else 0

    return dataclasses.replace(
        limits,
        requests_per_minute=part(limits.requests_per_minute),
        input_tokens_per_minute=part(limits.input_tokens_per_minute),
        output_tokens_per_minute=part(limits.output_tokens_per_minute),
        token_budget=part(limits.token_budget),
    )
