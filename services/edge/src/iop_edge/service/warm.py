"""Warm-aware scheduling (docs/ARCHITECTURE.md#warm-aware-scheduling): the selection rule
for models some of whose providers load them on demand (Ollama and the like).

The dispatcher asks here instead of the model's heap only when one of the model's
providers reports what it holds (``ModelIndex.loaders``); a pool of vLLM and llama.cpp
never reaches this module. The rule, over the model's candidates (``pool.standing``):

1. A provider that holds the model (its node's report, or a run of the model this edge
   sees answering there, or saw complete there since) with a free slot: the usual order
   among those (load ratio, then fleet position). Always-loaded providers are warm. A
   load is over at the loading run's first delta (the engine answers only once the model
   is in memory), not at its end: the requests held for it go then.
2. Else, while the model has a *home* (a warm provider, all busy; a provider this edge
   sent the model's first request to, loading it; a host that swaps finishing another
   model's work), the request is held at the edge, in the model's queue: the home will
   serve it sooner than a load elsewhere would. The hold lasts ``hold_factor`` times the
   measured load time (``assumed_load_s`` before any was measured; at most
   ``max_hold_s``) from the moment the model's queue began to wait, and never while the
   queue is full; then the request goes to a cold provider, as without this rule.
3. Else a cold provider with a free slot, by the usual order: its load begins, and the
   model's other requests are held for it (2), rather than each starting a load of its
   own on another host.

Hosts that swap (a ``max_loaded`` they have reached: loading another model unloads one):
a cold model does not start a load on one while it runs the loaded model's work, and its
freed slots go to the loaded model's waiters first (``order``), so requests are grouped
by model. No model starves: once another model of the host has waited ``group_wait_s``,
or the loaded model took ``group_grants`` freed slots in a row while another waited, the
waiting model goes first and the host swaps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterable, Mapping

from iop_edge.domain.pool import FULL, ModelIndex, ProviderSlot, standing
from iop_edge.domain.warmth import WarmPolicy
from iop_edge.ports import FleetView

SEEN_S = 2.0
"""A run of the model completed on a provider this recently: it is warm there, whatever a
snapshot sent before the run's end said. The node sends one right after the run's end,
with the model in it (its adapter counted the answer first), so the mark only bridges
that gap; kept longer, it would outlive an unload the node reports (``keep_alive``)."""


class WarmScheduler:
    """The rule above, with the little it remembers: loads this edge began, runs it sees
    answering or saw complete, the holds' start times and their wake-up timers."""

    def __init__(
        self,
        policy: WarmPolicy,
        fleet: FleetView,
        queued: Callable[[str], int],
        wake: Callable[[Iterable[str]], None],
    ) -> None:
        self.policy = policy
        self._fleet = fleet
        self._queued = queued  # a model's waiters now
        self._wake = wake  # serve these models' queues (a hold ended)
        self._loading: dict[tuple[str, str], float] = {}  # (model, provider): began
        self._seen: dict[tuple[str, str], float] = {}  # (provider, served): completed at
        self._answering: dict[tuple[str, str], int] = {}  # (model, provider): runs streaming
        self._hold: dict[str, float] = {}  # model: its queue began to wait
        self._swapped: dict[str, str] = {}  # provider (swaps): the served name it loads
        self._grants: dict[str, int] = {}  # provider (swaps): loaded model's grants in a row
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.tracking = False  # some model has a provider that loads on demand

    # ------------------------------------------------------------ selection

    def select(self, index: ModelIndex, exclude: Container[str] = ()) -> ProviderSlot | None:
        """The provider for the model's next request, or ``None`` (held, or no free slot)."""
        self.tracking = True
        model_id = index.model_id
        model = self._fleet.current.models.get(model_id)
        served = {} if model is None else model.providers
        now = asyncio.get_running_loop().time()
        if not self._queued(model_id):
            self._hold.pop(model_id, None)  # nobody waits: a new episode
        warm_best = cold_best = None
        warm_key = cold_key = (FULL, 0)
        home = False
        for position, slot in enumerate(index.members):
            provider_id = slot.provider_id
            load = None if provider_id in exclude else standing(slot)
            if load is None:
                continue
            name = served.get(provider_id, "")
            if self.warm(slot, name, now, model_id):
                home = True
                if (load, position) < warm_key:
                    warm_best, warm_key = slot, (load, position)
            elif (model_id, provider_id) in self._loading:
                home = True  # loading it: its waiters wait for it here
            elif load < FULL:
                report = slot.warmth
                if (
                    report is not None
                    and report.swaps
                    and slot.in_flight > 0
                    and not self._starving(model_id, provider_id, now)
                ):
                    home = True  # it finishes the loaded model's work first
                elif (load, position) < cold_key:
                    cold_best, cold_key = slot, (load, position)
        if warm_best is not None:
            self._granted(warm_best, model_id)
            return warm_best
        if home and self._holding(model_id, index, served, now):
            return None
        if cold_best is not None:
            self._began(model_id, cold_best, served.get(cold_best.provider_id, ""), now)
        return cold_best

    def warm(self, slot: ProviderSlot, name: str, now: float, model_id: str = "") -> bool:
        """``slot`` holds the served model ``name`` (of ``model_id``), or every model."""
        report = slot.warmth
        if report is None:
            return True
        swapped = self._swapped.get(slot.provider_id)
        if swapped is not None:
            if swapped in report.loaded:  # the node's word caught up with the swap
                del self._swapped[slot.provider_id]
                swapped = None
            elif swapped != name:
                return False  # told to load another: this one is on its way out
        if (model_id, slot.provider_id) in self._answering:
            return True  # a run of the model streams there: it is in memory
        seen = self._seen.get((slot.provider_id, name))
        if seen is not None and now - seen < SEEN_S:
            return True
        return swapped is None and name in report.loaded

    def order(self, slot: ProviderSlot) -> list[str]:
        """The models whose queues a freed slot of ``slot`` is offered to, in order: on a
        host that swaps, a starving cold model first, then the loaded ones."""
        model_ids = slot.model_ids()
        report = slot.warmth
        if report is None or not report.swaps or len(model_ids) < 2 or not self.policy.enabled:
            return model_ids
        models = self._fleet.current.models
        now = asyncio.get_running_loop().time()

        def rank(model_id: str) -> int:
            model = models.get(model_id)
            name = "" if model is None else model.providers.get(slot.provider_id, "")
            if self.warm(slot, name, now, model_id):
                return 1
            waiting = self._queued(model_id) > 0
            return 0 if waiting and self._starving(model_id, slot.provider_id, now) else 2

        return sorted(model_ids, key=rank)

    # ------------------------------------------------------------ what the dispatcher tells

    def answered(self, model_id: str, provider_id: str) -> bool:
        """A run of the model on the provider sent its first delta: the engine answers only
        once the model is in memory, so a load there is over now, not at the run's end (a
        long generation would keep the requests held for it waiting). Warm there while the
        run streams (``ended`` with ``answered``). True: the edge had counted it loading."""
        key = (model_id, provider_id)
        self._answering[key] = self._answering.get(key, 0) + 1
        return self._loading.pop(key, None) is not None

    def ended(
        self, model_id: str, provider_id: str, completed: bool, answered: bool = False
    ) -> None:
        """A run of the model on the provider ended; ``completed``: the model answered, so
        it is loaded there now; ``answered``: its first delta came (``answered``)."""
        key = (model_id, provider_id)
        self._loading.pop(key, None)
        if answered:
            left = self._answering.get(key, 0) - 1
            if left > 0:
                self._answering[key] = left
            else:
                self._answering.pop(key, None)
        if not completed:
            return
        model = self._fleet.current.models.get(model_id)
        name = "" if model is None else model.providers.get(provider_id, "")
        self._seen[(provider_id, name)] = asyncio.get_running_loop().time()

    def close(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()

    # ------------------------------------------------------------ internals

    def _began(self, model_id: str, slot: ProviderSlot, name: str, now: float) -> None:
        """A cold provider takes the model's request: its load begins."""
        provider_id = slot.provider_id
        self._loading[(model_id, provider_id)] = now
        self._grants.pop(provider_id, None)
        report = slot.warmth
        if report is not None and report.swaps:
            self._swapped[provider_id] = name
            for key in [k for k in self._seen if k[0] == provider_id and k[1] != name]:
                del self._seen[key]

    def _granted(self, slot: ProviderSlot, model_id: str) -> None:
        """A host that swaps gave its loaded model a slot: one more in a row, if another
        model of the host waits meanwhile."""
        report = slot.warmth
        if report is None or not report.swaps:
            return
        others = any(m != model_id and self._queued(m) for m in slot.model_ids())
        provider_id = slot.provider_id
        self._grants[provider_id] = self._grants.get(provider_id, 0) + 1 if others else 0

    def _holding(
        self, model_id: str, index: ModelIndex, served: Mapping[str, str], now: float
    ) -> bool:
        """The model's requests still wait for its home (rule 2)."""
        max_queue, _ = self._fleet.current.queue_limits(model_id)
        if self._queued(model_id) >= max_queue:
            return False  # a full queue would refuse the next request: spread instead
        since = self._hold.setdefault(model_id, now)
        until = since + self._bound(index, served)
        if now >= until:
            return False
        self._arm(model_id, until)
        return True

    def _bound(self, index: ModelIndex, served: Mapping[str, str]) -> float:
        """How long a hold lasts: ``hold_factor`` times the longest mean load time measured
        for the model on its providers (``assumed_load_s`` before any)."""
        policy = self.policy
        load_ms = 0
        for slot in index.members:
            report, name = slot.warmth, served.get(slot.provider_id, "")
            timing = None if report is None else report.timings.get(name)
            if timing is not None and timing.mean_ms > load_ms:
                load_ms = timing.mean_ms
        load_s = load_ms / 1000 if load_ms else policy.assumed_load_s
        return min(policy.max_hold_s, policy.hold_factor * load_s)

    def _starving(self, model_id: str, provider_id: str, now: float) -> bool:
        """A cold model of a host that swaps has waited long enough for it to swap."""
        if self._grants.get(provider_id, 0) >= self.policy.group_grants:
            return True
        since = self._hold.setdefault(model_id, now)
        until = since + self.policy.group_wait_s
        if now >= until:
            return True
        self._arm(model_id, until)
        return False

    def _arm(self, model_id: str, at: float) -> None:
        """Serve the model's queue at ``at`` (a hold ends then), once."""
        handle = self._timers.get(model_id)
        if handle is not None and not handle.cancelled() and handle.when() <= at:
            return
        if handle is not None:
            handle.cancel()
        loop = asyncio.get_running_loop()
        self._timers[model_id] = loop.call_at(at + 0.01, self._fire, model_id)

    def _fire(self, model_id: str) -> None:
        self._timers.pop(model_id, None)
        self._wake((model_id,))
