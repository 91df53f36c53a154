"""Outlier ejection (docs/ARCHITECTURE.md#outlier-ejection): a provider whose runs fail
again and again leaves selection for a cooldown, then earns its way back with one trial.

A node says whether its provider answers its probes (``health``); a provider can pass
those and still fail every run (a backend that answers ``/v1/models`` and 500s the
rest). The edge sees each run's end, so it keeps the count, as Envoy's outlier
detection (consecutive 5xx, ejection time growing with each ejection up to a cap) and
sgl-router's circuit breaker (closed, open, half-open with a trial) do:

- ``CLOSED``: in selection; ``consecutive_failures`` counts provider failures in a
  row (``faults.counts_against_provider``: never what the request caused), a completed
  run sets it back to 0. At the policy's threshold: ``EJECTED``, if the cap on the share
  of a model's providers ejected at once allows (``may_eject``).
- ``EJECTED``: out of selection until ``until`` (the k-th ejection in a row lasts
  ``k * cooldown_s``, at most ``max_cooldown_s``); outcomes of runs still in flight
  from before change nothing. The service layer's timer ends the cooldown.
- ``HALF_OPEN``: in selection for one run of this edge at a time (the trial). A
  completed run closes the circuit (counters back to 0), a provider failure ejects
  again, anything else (a cancellation, a 4xx) leaves the trial to the next run.

Pure state: the caller passes the time (``now``, in the clock ``until`` is read in)
and acts on the transitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from iop_edge.domain.events import Completed, Failed
from iop_edge.domain.faults import counts_against_provider


def may_eject(ejected: int, members: int, max_percent: float) -> bool:
    """Envoy's ``max_ejection_percent``, with its ``always_eject_one_host``: one more
    ejection leaves at most ``max_percent`` % of a model's ``members`` ejected, or none
    is ejected yet. The first is always allowed, so a model of one or two providers
    keeps outlier ejection at the default 10 %; past it the cap keeps a share of the
    model in selection, however many of its providers fail at once (then a failure is
    more likely the requests' or a shared dependency's than each provider's)."""
    return ejected == 0 or 100 * (ejected + 1) <= max_percent * members


class EjectionRoom(Protocol):
    """Whether the cap lets this provider be ejected now (``ProviderSlot``: the cap
    holds for each model it serves)."""

    def ejection_allowed(self, max_percent: float) -> bool: ...


class Phase(StrEnum):
    """Where a provider stands in outlier ejection (the catalog's ``outlier_state``)."""

    CLOSED = "closed"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """When to eject and for how long (the edge's ``outlier_*`` settings)."""

    consecutive_failures: int = 5  # provider failures in a row that eject; 0: never
    cooldown_s: float = 30.0  # the first ejection's length
    max_cooldown_s: float = 300.0  # the cap on ejections growing in a row
    max_ejection_percent: float = 10.0  # of a model's providers ejected at once (``may_eject``)

    @property
    def enabled(self) -> bool:
        return self.consecutive_failures > 0

    def cooldown(self, ejections: int) -> float:
        """Length of the ``ejections``-th ejection in a row (1 for the first)."""
        return min(self.cooldown_s * max(ejections, 1), max(self.max_cooldown_s, self.cooldown_s))


@dataclass(slots=True)
class OutlierState:
    """One provider's outlier ejection state (held by its ``ProviderSlot``)."""

    phase: Phase = Phase.CLOSED
    consecutive_failures: int = 0
    ejections: int = 0  # ejections in a row, with no successful trial between
    until: float = 0.0  # while ``EJECTED``: when the cooldown ends; else 0

    def record(
        self,
        outcome: Completed | Failed | None,
        now: float,
        policy: OutlierPolicy,
        *,
        drill: bool = False,
        room: EjectionRoom | None = None,
    ) -> bool:
        """Count a run's end (``None``: it ended without one, e.g. never sent; ``drill``:
        its request asked the mock to fail, so a failure is not the provider's); tells
        whether the phase changed (the slot's place in selection with it). An ejection
        that ``room`` refuses (``max_ejection_percent``) leaves the provider where it is,
        its count growing: the next failure asks again."""
        if policy.consecutive_failures <= 0 or self.phase is Phase.EJECTED:  # not ``enabled``
            return False
        if isinstance(outcome, Completed):
            self.consecutive_failures = 0
            if self.phase is Phase.HALF_OPEN:
                self.phase, self.ejections = Phase.CLOSED, 0
                return True
            return False
        if not isinstance(outcome, Failed) or not counts_against_provider(outcome, drill=drill):
            return False
        failures = self.consecutive_failures = self.consecutive_failures + 1
        if self.phase is not Phase.HALF_OPEN and failures < policy.consecutive_failures:
            return False
        if room is None or room.ejection_allowed(policy.max_ejection_percent):
            self.ejections += 1
            self.phase = Phase.EJECTED
            self.until = now + policy.cooldown(self.ejections)
            return True
        return False

    def end_cooldown(self) -> bool:
        """The cooldown is over: on to the trial. False when not ejected (nothing changes)."""
        if self.phase is not Phase.EJECTED:
            return False
        self.phase, self.until = Phase.HALF_OPEN, 0.0
        return True
