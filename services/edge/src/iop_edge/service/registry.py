"""The provider registry: the live pool (one slot per provider, one index per model)
and the node links, the one place either is kept.

The node listener registers and unregisters connections here and feeds it
snapshots; a fleet config rebuilds it. Slot state changes only through the
slot's ``take``/``release``/``update``, so the indexes never fall behind. What
the dispatcher must act on (slots changed for some models, a link gone) it is
told through the ``PoolListener`` it subscribed; everyone else reads through the
read-only views of ``ports`` (``ProviderView``).

Outlier ejection (``domain/outliers.py``) is decided by the slots; the registry gives
them the time, is told each run's end (``record_outcome``) and owns the loop timers
that end cooldowns, after which the queues of the provider's models are served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from loguru import logger

from iop_edge.domain.events import Completed, Failed, ProviderLoad, ProviderReport
from iop_edge.domain.faults import counts_against_provider
from iop_edge.domain.fleet import Fleet, Operation
from iop_edge.domain.outliers import OutlierPolicy, Phase
from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE, ModelIndex, ProviderSlot, index_models
from iop_edge.metrics import EdgeMetrics
from iop_edge.service.fleet_holder import FleetHolder
from iop_edge.service.runs import NodeLink


class PoolListener(Protocol):
    """What the dispatcher hears from the registry (it serves its queues from it)."""

    def slots_changed(self, model_ids: Iterable[str]) -> None:
        """Slots of these models (in fleet order) may have room now."""
        ...

    def fleet_applied(self, fleet: Fleet) -> None:
        """The pool was rebuilt for ``fleet``: queues follow its models."""
        ...

    def link_lost(self, link: NodeLink, reason: str) -> None:
        """The connection is gone: whatever runs on it ends with an error."""
        ...


class ProviderRegistry:
    """Implements ``ProviderView``; owns the slots, the indexes and the node links."""

    def __init__(
        self,
        fleet: FleetHolder,
        metrics: EdgeMetrics,
        outliers: OutlierPolicy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._outliers = outliers
        self._clock = clock  # wall time: the catalog shows when an ejection ends
        self._cooldowns: dict[str, asyncio.TimerHandle] = {}  # ejected providers' timers
        self._slots: dict[str, ProviderSlot] = {}
        # Each model's index, read only: a plain attribute, replaced whole by
        # ``apply_fleet`` (whoever reads it gets every model's index of one fleet).
        self.indexes: Mapping[str, ModelIndex] = {}
        self._model_rank: dict[str, int] = {}  # fleet order, in which queues are served
        self._links: dict[str, NodeLink] = {}
        # Each registered node's current connection, read only (absent: not registered).
        self.links: Mapping[str, NodeLink] = self._links
        self._listener: PoolListener | None = None
        metrics.watch_slots(self._slots.values)  # the pool's gauges, read at scrape time

    def subscribe(self, listener: PoolListener) -> None:
        """The one listener (the dispatcher) told of every change it must act on."""
        self._listener = listener

    # ------------------------------------------------------------ reads

    def slot(self, provider_id: str) -> ProviderSlot | None:
        return self._slots.get(provider_id)

    def slots(self) -> Sequence[ProviderSlot]:
        """Every provider of the fleet, in the fleet file's order."""
        return tuple(self._slots.values())

    # ------------------------------------------------------------ changes

    def apply_fleet(self, fleet: Fleet) -> None:
        """Swap in a new fleet config; live state of providers that stay is kept."""
        self._fleet.replace(fleet)
        slots = self._slots
        for provider_id in list(slots):
            if provider_id not in fleet.providers:
                slots.pop(provider_id).detach()
                self._cancel_cooldown(provider_id)
                self._metrics.forget_provider(provider_id)
        for entry in fleet.providers.values():
            slot = slots.get(entry.id)
            if slot is None:
                slot = slots[entry.id] = ProviderSlot(entry.id, entry.node_id)
                self._metrics.track_provider(entry.id)
            slot.node_id, slot.type, slot.category = entry.node_id, entry.type, entry.category
            slot.offer(entry.operations)  # what it refused is tried again under a new fleet
            # connected follows the node, also for a provider moved to another node
            slot.update(capacity=entry.capacity, connected=entry.node_id in self._links)
        self.indexes = index_models(
            (
                (m.id, [slots[p] for p in m.providers if p in slots], m.preference)
                for m in fleet.models.values()
            ),
            slots.values(),
        )
        self._model_rank = {model_id: rank for rank, model_id in enumerate(fleet.models)}
        if self._listener is not None:
            self._listener.fleet_applied(fleet)

    def node_connected(self, link: NodeLink, providers: Iterable[ProviderReport]) -> None:
        """Register ``link`` as its node's connection (a previous one is replaced)."""
        self._links[link.node_id] = link
        self._metrics.nodes_connected.set(len(self._links))
        for slot in self._slots_of_node(link.node_id):
            slot.update(connected=True)
            slot.offer(slot.declared)  # maybe restarted with what it lacked (--embeddings)
        self.apply_snapshot(link.node_id, providers)

    def node_disconnected(self, link: NodeLink, reason: str) -> None:
        """The node's providers are unavailable at once and the connection's runs end
        with an error (a replaced connection's runs too: nothing else can end them)."""
        if self._links.get(link.node_id) is link:  # else a newer connection replaced it
            del self._links[link.node_id]
            self._metrics.nodes_connected.set(len(self._links))
            for slot in self._slots_of_node(link.node_id):
                slot.update(connected=False, reported_in_flight=0)
        if self._listener is not None:
            self._listener.link_lost(link, reason)

    def apply_snapshot(self, node_id: str, providers: Iterable[ProviderReport]) -> None:
        changed: set[str] = set()
        for state in providers:
            slot = self._slots.get(state.provider_id)
            if slot is None or slot.node_id != node_id:
                continue  # not in the fleet (or not this node's): never routable
            slot.update(health=state.health, reported_in_flight=state.in_flight)
            slot.node_queued = state.queued
            slot.models = state.models
            slot.detail = state.detail
            slot.lifecycle = dict(state.lifecycle or {})
            slot.engine = dict(state.engine or slot.engine)  # kept until the node says again
            if state.cache is not None:
                # Plain data for selection to read: it changes no load, so no index moves.
                slot.cache = state.cache
            slot.report_loads(state.loaded)
            changed.update(slot.model_ids())
        if self._listener is not None:
            self._listener.slots_changed(sorted(changed, key=self._model_rank.__getitem__))

    def apply_load(self, node_id: str, provider_id: str, load: ProviderLoad) -> None:
        """What a run's end says of its provider (the run's own: the run's events come
        from its node's connection only), after the edge let go of the run's slot: the
        snapshot's load and cache without the snapshot. Only a changed count moves the
        indexes and serves the queues."""
        slot = self._slots.get(provider_id)
        if slot is None or slot.node_id != node_id:
            return  # left the fleet, or moved to another node, since the run started
        slot.node_queued = load.queued
        if load.cache is not None:
            slot.cache = load.cache
        if load.in_flight != slot.reported_in_flight:
            slot.update(reported_in_flight=load.in_flight)
            if self._listener is not None:
                self._listener.slots_changed(
                    sorted(slot.model_ids(), key=self._model_rank.__getitem__)
                )

    def mark_unavailable(self, provider_id: str) -> None:
        """The node found its provider unreachable: stop routing to it now rather than
        at the node's next snapshot (which also brings it back when it is)."""
        slot = self._slots.get(provider_id)
        if slot is not None and slot.health == AVAILABLE:
            slot.update(health=UNAVAILABLE)

    def refuse_operation(self, provider_id: str, operation: Operation) -> None:
        """The provider answered 501 for ``operation`` (it does not offer it, e.g. a
        llama.cpp started without ``--embeddings``): it is not chosen for it until its
        node connects again or the fleet changes, and the catalog says so."""
        slot = self._slots.get(provider_id)
        if slot is not None and slot.refuse(operation):
            logger.warning(
                "provider {} does not offer {} (it answered 501): not chosen for it until"
                " its node reconnects or the fleet changes",
                provider_id,
                operation.value,
            )

    def record_outcome(
        self,
        provider_id: str,
        outcome: Completed | Failed | None,
        *,
        drill: bool = False,
        release: bool = False,
    ) -> ProviderSlot | None:
        """A run on the provider ended (``outcome``: its terminal event, ``None`` if it
        never had one; ``drill``: its request asked for its failure; ``release``: it held
        one of the provider's places, which goes back now): count it for outlier ejection,
        and time the cooldown of an ejection it causes. A run lost with its node's link is
        not counted: the link's state takes the provider out already, and the provider may
        be fine. Returns the slot when a place went back (its models' waiters may move)."""
        slot = self._slots.get(provider_id)
        if slot is None:
            return None
        freed = slot if release else None
        if not slot.connected:
            if release:
                slot.release()
            return freed
        now = self._clock()
        if release:
            changed = slot.release(outcome, now, self._outliers, drill=drill)
        else:
            changed = slot.record_outcome(outcome, now, self._outliers, drill=drill)
        if not changed:
            failures = slot.outlier.consecutive_failures
            if (
                failures == self._outliers.consecutive_failures > 0
                and slot.outlier.phase is not Phase.EJECTED
                and isinstance(outcome, Failed)
                and counts_against_provider(outcome, drill=drill)
            ):  # this failure reached the threshold, and the cap refused (once a streak)
                logger.warning(
                    "provider {} failed {} runs in a row but stays in selection: ejecting it"
                    " would take its model past max_ejection_percent ({:g}%)",
                    provider_id,
                    failures,
                    self._outliers.max_ejection_percent,
                )
            return freed
        state = slot.outlier
        if state.phase is Phase.EJECTED:
            self._metrics.count_ejection(slot)
            delay = max(state.until - now, 0.0)
            logger.warning(
                "provider {} ejected from selection for {:.3g}s after {} provider failures in"
                " a row (ejection {} in a row); then one trial run",
                provider_id,
                delay,
                state.consecutive_failures,
                state.ejections,
            )
            self._cancel_cooldown(provider_id)
            loop = asyncio.get_running_loop()
            self._cooldowns[provider_id] = loop.call_later(delay, self._end_cooldown, slot)
        else:
            logger.info("provider {} passed its trial run: back in selection", provider_id)
        return freed

    def _end_cooldown(self, slot: ProviderSlot) -> None:
        self._cooldowns.pop(slot.provider_id, None)
        if self._slots.get(slot.provider_id) is not slot or not slot.end_ejection():
            return  # the provider left the fleet meanwhile
        logger.info("provider {} cooldown over: its next run is a trial", slot.provider_id)
        if self._listener is not None:
            self._listener.slots_changed(sorted(slot.model_ids(), key=self._model_rank.__getitem__))

    def _cancel_cooldown(self, provider_id: str) -> None:
        handle = self._cooldowns.pop(provider_id, None)
        if handle is not None:
            handle.cancel()

    def close(self) -> None:
        """Stop the cooldown timers (the edge is stopping)."""
        for provider_id in list(self._cooldowns):
            self._cancel_cooldown(provider_id)

    def node_unresponsive(self, node_id: str, reason: str) -> None:
        """The node did not acknowledge a run in time: none of its providers is chosen
        until it speaks again (its next snapshot says what they are), while its
        connection, and the runs it did acknowledge, stay to the heartbeats to judge."""
        for slot in self._slots_of_node(node_id):
            if slot.health == AVAILABLE:
                slot.update(health=UNAVAILABLE)
                slot.detail = f"node unresponsive: {reason}"

    def _slots_of_node(self, node_id: str) -> list[ProviderSlot]:
        return [slot for slot in self._slots.values() if slot.node_id == node_id]
