"""Provider pools and the selection rule (seed D02, S04).

Candidates for a model are its providers whose node is connected, whose health
is ``available`` and whose capacity is above zero. Among those with a free slot
the lowest ``in_flight / capacity`` wins; equal ratios go to the provider that
comes first in the fleet file (``nodes[]``, then each node's ``providers[]``), so
the choice is deterministic and the operator decides it. A provider is never
preferred for having more free slots when its ratio is higher: 1/3 beats 2/3
even though 2/3 of 6 leaves more room.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

AVAILABLE = "available"
UNAVAILABLE = "unavailable"
UNKNOWN = "unknown"

LIFECYCLE_FLAGS = ("list_models", "load_model", "unload_model", "pull_model", "delete_model")


@dataclass(eq=False, slots=True)
class ProviderSlot:
    """Live state of one provider as the edge sees it.

    ``own_in_flight`` counts the runs this edge dispatched and has not seen end:
    it moves at once, before any snapshot. ``reported_in_flight`` is the node's
    last word, which also covers other edges' runs; it is lowered with each of
    our own releases so a snapshot that lags behind never blocks a freed slot.
    """

    provider_id: str
    node_id: str
    type: str = ""
    category: str = ""
    capacity: int = 0
    connected: bool = False
    health: str = UNKNOWN
    own_in_flight: int = 0
    reported_in_flight: int = 0
    node_queued: int = 0
    models: tuple[str, ...] = ()
    lifecycle: dict[str, bool] = field(default_factory=dict)
    detail: str = ""

    @property
    def in_flight(self) -> int:
        return max(self.own_in_flight, self.reported_in_flight)

    @property
    def load_ratio(self) -> float:
        return self.in_flight / self.capacity if self.capacity > 0 else 1.0

    @property
    def usable(self) -> bool:
        """A candidate at all (free slot or not)."""
        return self.connected and self.health == AVAILABLE and self.capacity > 0

    @property
    def has_free_slot(self) -> bool:
        return self.usable and self.in_flight < self.capacity

    def take(self) -> None:
        self.own_in_flight += 1

    def release(self) -> None:
        if self.own_in_flight > 0:
            self.own_in_flight -= 1
        if self.reported_in_flight > 0:
            self.reported_in_flight -= 1


def select(candidates: Iterable[ProviderSlot]) -> ProviderSlot | None:
    """The candidate with a free slot and the lowest load ratio; the first listed on ties.

    ``candidates`` must come in the model's provider order. One pass, no sorting:
    this runs for every request.
    """
    best: ProviderSlot | None = None
    best_ratio = 2.0
    for slot in candidates:
        # Plain attribute reads, no properties: this loop runs for every request.
        capacity = slot.capacity
        if capacity <= 0 or not slot.connected or slot.health != AVAILABLE:
            continue
        own, reported = slot.own_in_flight, slot.reported_in_flight
        in_flight = own if own > reported else reported
        if in_flight >= capacity:
            continue
        ratio = in_flight / capacity
        if ratio < best_ratio:  # strictly lower: an equal ratio keeps the earlier one
            best, best_ratio = slot, ratio
    return best
