"""Provider pools and the selection rule (docs/ARCHITECTURE.md#selection).

Candidates for a model are its providers whose node is connected, whose health
is ``available``, whose capacity is above zero and that are not ejected for failing
run after run (``outliers``; on trial, a provider takes one run of ours at a time).
Among those with a free slot the lowest ``in_flight / capacity`` wins; equal ratios
go to the provider that comes first in the fleet file (``nodes[]``, then each node's
``providers[]``), so the choice is deterministic and the operator decides it. A
provider is never preferred for having more free slots when its ratio is higher:
1/3 beats 2/3 even though 2/3 of 6 leaves more room.

The rule is stated once, in ``standing`` (is a provider a candidate, and at what
load) and the order ``(load, position in the model)``; ``select`` applies it as one
pass over a model's providers, and the index applies the very same. The dispatcher
does not scan: each model has a ``ModelIndex``, a heap of its providers that have
a free slot, keyed ``(ratio, position in the model)`` and kept current by the
slots themselves, so a decision costs O(log n) whatever the pool size. Every
change of what selection depends on goes through ``ProviderSlot.take``,
``release``, ``update``, ``record_outcome`` or ``end_ejection``, which push a
fresh heap entry and retire the old ones (each entry carries the slot's version;
an entry whose version is behind is dropped when it reaches the top).

Operations: a provider offers some of ``chat_completions``, ``completions``,
``embeddings`` (the fleet file's ``operations``, less what it answered 501 for). A
request for an operation only some providers of the model offer excludes the others
(``ModelIndex.lacking``: one dict lookup, empty in a pool whose providers all offer
everything), as a retry excludes the providers it failed on.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.controls import preference_tiers
from iop_edge.domain.events import Completed, Failed
from iop_edge.domain.fleet import ALL_OPERATIONS, PUBLIC_OPERATIONS, Operation
from iop_edge.domain.outliers import OutlierPolicy, OutlierState, Phase, may_eject
from iop_edge.domain.warmth import LoadReport

AVAILABLE = "available"
UNAVAILABLE = "unavailable"
UNKNOWN = "unknown"

LIFECYCLE_FLAGS = ("list_models", "load_model", "unload_model", "pull_model", "delete_model")

# (load ratio, position in the model's provider order, slot version, slot): the order
# of selection, then what retires the entry. Positions are unique in a model and a
# slot's versions only grow, so tuple comparison never reaches the slot itself.
_Entry = tuple[float, int, int, "ProviderSlot"]

_CLOSED, _EJECTED = Phase.CLOSED, Phase.EJECTED  # the phases ``standing`` tells apart

FULL = 1.0
"""A ``standing`` at or above this is a candidate with no free slot (``in_flight >=
capacity`` exactly when ``in_flight / capacity >= 1``)."""


def standing(slot: ProviderSlot) -> float | None:
    """The selection rule, the one place it is written: ``None`` when the provider is no
    candidate at all (node gone, not ``available``, no capacity, ejected), else its load
    ratio, below ``FULL`` exactly when it has a free slot (on trial: only while no run of
    ours is on it). Lower wins; ties go to the earlier position in the model's provider
    order."""
    capacity = slot.capacity
    if capacity <= 0 or not slot.connected or slot.health != AVAILABLE:
        return None
    own, reported = slot.own_in_flight, slot.reported_in_flight
    phase = slot.outlier.phase
    if phase is not _CLOSED:
        if phase is _EJECTED:
            return None
        if own > 0:  # half-open: the one trial is under way
            return FULL
    return (own if own > reported else reported) / capacity


@dataclass(eq=False, slots=True)
class ProviderSlot:
    """Live state of one provider as the edge sees it.

    ``own_in_flight`` counts the runs this edge dispatched and has not seen end:
    it moves at once, before any snapshot. ``reported_in_flight`` is the node's
    last word, which also covers other edges' runs; it is lowered with each of
    our own releases so a snapshot that lags behind never blocks a freed slot.

    Change ``capacity``, ``connected``, ``health``, the in-flight counts and ``outlier``
    only through ``take``, ``release``, ``update``, ``record_outcome`` and
    ``end_ejection``: they keep the slot's place in the indexes of the models it
    serves. The other fields are descriptive.
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
    outlier: OutlierState = field(default_factory=OutlierState)
    # What it offers: ``declared`` (the fleet file) less ``refused`` (answered 501 for).
    declared: frozenset[Operation] = ALL_OPERATIONS
    refused: frozenset[Operation] = frozenset()
    operations: frozenset[Operation] = ALL_OPERATIONS
    # What its engine's prompt cache holds, by the node's last snapshot.
    cache: CacheReport = field(default_factory=CacheReport)
    engine: dict[str, str | int] = field(default_factory=dict)  # its engine, device (catalog)
    # What it holds in memory, for a provider that loads models on demand (``report_loads``).
    warmth: LoadReport | None = None
    # The indexes this slot is in, with its position in each, and what they last saw.
    _indexes: list[tuple[ModelIndex, int]] = field(default_factory=list, init=False, repr=False)
    # Grows with every change selection depends on: an index entry of an older version is
    # stale. Written only by the slot itself (``_reindex``, ``detach``).
    version: int = field(default=0, init=False, repr=False)
    _usable: bool = field(default=False, init=False, repr=False)

    @property
    def in_flight(self) -> int:
        return max(self.own_in_flight, self.reported_in_flight)

    @property
    def load_ratio(self) -> float:
        return self.in_flight / self.capacity if self.capacity > 0 else 1.0

    @property
    def usable(self) -> bool:
        """A candidate at all (free slot or not)."""
        return standing(self) is not None

    @property
    def has_free_slot(self) -> bool:
        load = standing(self)
        return load is not None and load < FULL

    def take(self) -> None:
        self.own_in_flight += 1
        self._reindex()

    def release(
        self,
        outcome: Completed | Failed | None = None,
        now: float = 0.0,
        policy: OutlierPolicy | None = None,
        *,
        drill: bool = False,
    ) -> bool:
        """A run of ours on this provider gave its place back. With a ``policy``, its
        ``outcome`` is counted for outlier ejection as well (as ``record_outcome``), and
        the slot moves in its indexes once for both; tells whether the provider was
        ejected or closed its circuit by it."""
        if self.own_in_flight > 0:
            self.own_in_flight -= 1
        if self.reported_in_flight > 0:
            self.reported_in_flight -= 1
        changed = policy is not None and self.outlier.record(
            outcome, now, policy, drill=drill, room=self
        )
        self._reindex()
        return changed

    def update(
        self,
        *,
        connected: bool | None = None,
        health: str | None = None,
        reported_in_flight: int | None = None,
        capacity: int | None = None,
    ) -> None:
        """Set what selection depends on (``None``: unchanged); the indexes follow."""
        before = (self.connected, self.health, self.reported_in_flight, self.capacity)
        if connected is not None:
            self.connected = connected
        if health is not None:
            self.health = health
        if reported_in_flight is not None:
            self.reported_in_flight = reported_in_flight
        if capacity is not None:
            self.capacity = capacity
        if (self.connected, self.health, self.reported_in_flight, self.capacity) != before:
            self._reindex()

    def record_outcome(
        self,
        outcome: Completed | Failed | None,
        now: float,
        policy: OutlierPolicy,
        *,
        drill: bool = False,
    ) -> bool:
        """A run on this provider ended with ``outcome``: count it for outlier ejection
        (``now`` in the clock ``outlier.until`` is read in; ``drill``: the request asked
        for its failure); tells whether the provider was ejected or closed its circuit
        by it."""
        changed = self.outlier.record(outcome, now, policy, drill=drill, room=self)
        if changed:
            self._reindex()
        return changed

    def ejection_allowed(self, max_percent: float) -> bool:
        """``max_ejection_percent`` lets this provider be ejected: in each model it serves
        (``outliers.may_eject``; a provider of no model has nobody to leave short)."""
        for index, _ in self._indexes:
            if not may_eject(index.ejected_count(), len(index.members), max_percent):
                return False
        return True

    def end_ejection(self) -> bool:
        """The cooldown is over: the provider is on trial (False: it was not ejected)."""
        changed = self.outlier.end_cooldown()
        if changed:
            self._reindex()
        return changed

    def offer(self, declared: frozenset[Operation]) -> None:
        """What the fleet file says it offers; what it refused is forgotten (a fleet
        change or a new connection of its node: the provider may have been restarted)."""
        self.declared, self.refused = declared, frozenset()
        self._set_operations(declared)

    def refuse(self, operation: Operation) -> bool:
        """The provider answered 501 for ``operation``: it is not chosen for it any more;
        tells whether that is news."""
        if operation in self.refused:
            return False
        self.refused = self.refused | {operation}
        self._set_operations(self.declared - self.refused)
        return True

    def _set_operations(self, operations: frozenset[Operation]) -> None:
        if operations != self.operations:
            self.operations = operations
            for index, _ in self._indexes:
                index.count_operations()

    def report_loads(self, report: LoadReport | None) -> None:
        """The node's word on what it holds (``None``: every model, always); the indexes
        count their members that load on demand (``ModelIndex.loaders``)."""
        if (report is None) != (self.warmth is None):
            for index, _ in self._indexes:
                index.loaders += 1 if report is not None else -1
        self.warmth = report

    def model_ids(self) -> list[str]:
        """The models whose index holds this slot, in the order the indexes were built."""
        return [index.model_id for index, _ in self._indexes]

    def join(self, index: ModelIndex, position: int) -> bool:
        """Enter ``index`` at ``position``; tells whether the slot is usable now."""
        self._indexes.append((index, position))
        self._usable = usable = standing(self) is not None
        return usable

    def detach(self) -> None:
        """Leave every index (before they are rebuilt, or when the provider goes)."""
        self._indexes.clear()
        self.version += 1

    def _reindex(self) -> None:
        self.version = version = self.version + 1
        load = standing(self)
        usable = load is not None
        if usable != self._usable:
            self._usable = usable
            step = 1 if usable else -1
            for index, _ in self._indexes:
                index.count_usable(step)
        if load is not None and load < FULL:
            for index, position in self._indexes:
                index.push((load + index.tiers[position], position, version, self))


class ModelIndex:
    """One model's providers, ready for selection: ``select`` gives what ``select()``
    over the model's providers in order would, in O(log n).

    A heap of the providers with a free slot, in the order ``(standing, position)``;
    entries go stale when their slot changes (the slot pushes a fresh one) and are
    dropped lazily: at the top by ``select``, all at once when stale ones outnumber
    the members about 2 to 1. ``usable_count`` counts the usable members, free slot
    or not.
    """

    __slots__ = (
        "_heap",
        "_limit",
        "_usable_count",
        "lacking",
        "loaders",
        "members",
        "model_id",
        "tiers",
    )

    def __init__(
        self, model_id: str, members: Sequence[ProviderSlot], preference: Sequence[str] = ()
    ) -> None:
        """``members`` in the model's provider order (the tie-break); ``preference``: an
        operator's order of them (``domain.controls``: tiers before the load ratio)."""
        self.model_id = model_id
        self.members = tuple(members)
        self.tiers = preference_tiers([slot.provider_id for slot in self.members], preference)
        self._usable_count = 0
        self._limit = 3 * len(self.members) + 64
        for position, slot in enumerate(self.members):
            self._usable_count += slot.join(self, position)
        # Members that load models on demand: 0 keeps selection to the heap alone.
        self.loaders = sum(1 for slot in self.members if slot.warmth is not None)
        self._heap: list[_Entry] = []
        self._rebuild()
        self.lacking: dict[Operation, frozenset[str]] = {}
        self.count_operations()

    def count_operations(self) -> None:
        """``lacking``: for each operation some member does not offer, the ids of those
        members (absent: all offer it). A member's operations changed, or it joined."""
        members = self.members
        found: dict[Operation, frozenset[str]] = {}
        for operation in Operation:
            lacking = frozenset(s.provider_id for s in members if operation not in s.operations)
            if lacking:
                found[operation] = lacking
        self.lacking = found  # whole: a request never sees half of a change

    def offers(self, operation: Operation) -> bool:
        """Some member offers ``operation`` (a model without members offers everything:
        it has nobody to refuse, and no provider either)."""
        lacking = self.lacking.get(operation)
        return lacking is None or len(lacking) < len(self.members)

    @property
    def operations(self) -> list[Operation]:
        """What some member offers, in the catalog's order (public operations only)."""
        return [operation for operation in PUBLIC_OPERATIONS if self.offers(operation)]

    @property
    def usable_count(self) -> int:
        return self._usable_count

    def ejected_count(self) -> int:
        """Members out of selection for outlier ejection now (asked only when one more
        would be: a scan, not a count kept on every run's end)."""
        return sum(1 for slot in self.members if slot.outlier.phase is _EJECTED)

    @property
    def any_usable(self) -> bool:
        return self._usable_count > 0

    def select(self, exclude: Container[str] = ()) -> ProviderSlot | None:
        """The member with a free slot and the lowest load ratio; the first listed on ties.

        ``exclude``: provider ids a retry may not go back to (docs/ARCHITECTURE.md#failover);
        their entries are set aside while the heap is searched, then put back.
        """
        heap = self._heap
        if exclude:
            return self._select_excluding(exclude)
        while heap:
            _, _, version, slot = heap[0]
            if version == slot.version:
                return slot
            heapq.heappop(heap)
        return None

    def _select_excluding(self, exclude: Container[str]) -> ProviderSlot | None:
        heap = self._heap
        aside: list[_Entry] = []
        found = None
        while heap:
            entry = heap[0]
            slot = entry[3]
            if entry[2] != slot.version:
                heapq.heappop(heap)
            elif slot.provider_id in exclude:
                aside.append(heapq.heappop(heap))
            else:
                found = slot
                break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def least_loaded(self, exclude: Container[str] = ()) -> ProviderSlot | None:
        """The usable member outside ``exclude`` with the lowest load ratio, free slot or
        not (the first listed on ties): for work that takes no slot (``count_tokens``)."""
        best: ProviderSlot | None = None
        best_key = (0.0, 0)
        for position, slot in enumerate(self.members):
            load = None if slot.provider_id in exclude else standing(slot)
            if load is not None and (best is None or (load, position) < best_key):
                best, best_key = slot, (load, position)
        return best

    def any_usable_except(self, exclude: Container[str]) -> bool:
        """A member outside ``exclude`` is a candidate (free slot or not)."""
        return any(s.provider_id not in exclude and s.usable for s in self.members)

    def count_usable(self, step: int) -> None:
        """A member became usable (+1) or stopped being so (-1)."""
        self._usable_count += step

    def push(self, entry: _Entry) -> None:
        """A member's fresh place; its older entries are now stale."""
        heapq.heappush(self._heap, entry)
        if len(self._heap) > self._limit:
            self._rebuild()

    def _rebuild(self) -> None:
        # The members' current places, straight from the rule: every stale entry goes.
        heap: list[_Entry] = []
        for position, slot in enumerate(self.members):
            load = standing(slot)
            if load is not None and load < FULL:
                heap.append((load + self.tiers[position], position, slot.version, slot))
        heapq.heapify(heap)
        self._heap = heap


def index_models(
    models: Iterable[
        tuple[str, Sequence[ProviderSlot]] | tuple[str, Sequence[ProviderSlot], Sequence[str]]
    ],
    slots: Iterable[ProviderSlot],
) -> dict[str, ModelIndex]:
    """Fresh indexes for ``models`` (model id, its slots in provider order, and maybe its
    preference); every one of ``slots`` leaves the indexes it was in first."""
    for slot in slots:
        slot.detach()
    return {entry[0]: ModelIndex(*entry) for entry in models}


def select(candidates: Iterable[ProviderSlot]) -> ProviderSlot | None:
    """The candidate with a free slot and the lowest load ratio; the first listed on ties.

    ``candidates`` must come in the model's provider order. The rule (``standing``,
    then position) as a scan: the reference ``ModelIndex.select`` is held to (tests
    compare the two).
    """
    best: ProviderSlot | None = None
    best_key = (FULL, 0)
    for position, slot in enumerate(candidates):
        load = standing(slot)
        if load is not None and (load, position) < best_key:
            best, best_key = slot, (load, position)
    return best
