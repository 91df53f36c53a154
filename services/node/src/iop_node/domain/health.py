"""Provider health with hysteresis: states change only after N consecutive probe results.

A single failed probe (a GC pause, a slow model load) must not flip a provider
out of its pool, and a single success must not put a flapping one back. Only the
three states of the seed exist: unknown, available, unavailable.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

DEFAULT_RISE = 1  # consecutive successes before available (from unknown or unavailable)
DEFAULT_FALL = 2  # consecutive failures before unavailable (from available)


class Health(StrEnum):
    UNKNOWN = "unknown"
    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe: did the provider answer, which models does it serve, and why not."""

    ok: bool
    models: tuple[str, ...] = ()
    detail: str = ""


class HealthTracker:
    """Turns a stream of probe results into a health state with hysteresis.

    ``rise`` consecutive successes make a provider available, ``fall``
    consecutive failures make an available one unavailable. From ``unknown`` a
    single failure is enough: nothing has been seen working yet, and routing to
    it would only produce errors.
    """

    def __init__(self, rise: int = DEFAULT_RISE, fall: int = DEFAULT_FALL) -> None:
        if rise < 1 or fall < 1:
            raise ValueError("rise and fall must be at least 1")
        self.rise = rise
        self.fall = fall
        self.state = Health.UNKNOWN
        self.models: tuple[str, ...] = ()
        self.detail = "not probed yet"
        self._streak_ok = 0
        self._streak_failed = 0

    def observe(self, result: ProbeResult) -> bool:
        """Record one probe; returns True when the state changed."""
        before = self.state
        if result.ok:
            self._streak_ok += 1
            self._streak_failed = 0
            self.models = result.models
            self.detail = result.detail
            if self.state is not Health.AVAILABLE and self._streak_ok >= self.rise:
                self.state = Health.AVAILABLE
        else:
            self._streak_failed += 1
            self._streak_ok = 0
            self.detail = result.detail or "probe failed"
            needed = 1 if self.state is Health.UNKNOWN else self.fall
            if self.state is not Health.UNAVAILABLE and self._streak_failed >= needed:
                self.state = Health.UNAVAILABLE
        return self.state is not before

    def mark_unavailable(self, detail: str) -> bool:
        """A run just failed to reach the provider: no need to wait for the next probe."""
        before = self.state
        self.state = Health.UNAVAILABLE
        self.detail = detail
        self._streak_ok = 0
        self._streak_failed = self.fall
        return self.state is not before
