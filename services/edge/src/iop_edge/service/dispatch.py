"""Dispatch: the model id stays the key until the last moment, then a provider is
chosen (docs/ARCHITECTURE.md#selection), the target rewritten to its served name
(docs/ARCHITECTURE.md#target-rewrite), and the run sent to its node.

Owns the per-model queues (fair across keys: ``domain/queue.py``; batch lines as
backfill: ``service/backfill.py``) and the runs in flight, nothing else: the pool
and the node links are the ``ProviderRegistry``'s, the fleet the ``FleetHolder``'s.
Each request's run (``RequestRun``) is made here at admission and owns the request
from then on: its place in a queue, the slot handed to it, each attempt. Every release
(and every change the registry reports) first serves the queues of the models it can
serve. A run that fails before its first byte is opened again here, on another
provider (``reopen``, in its reader's task: docs/ARCHITECTURE.md#failover).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence

from iop_edge.domain.affinity import AffinityPolicy, CacheAffinity, Preference
from iop_edge.domain.events import (
    NOT_IMPLEMENTED,
    Completed,
    ErrorCode,
    Failed,
    RunOrder,
)
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation
from iop_edge.domain.pin import PinUnknown, pinned_out
from iop_edge.domain.pool import ModelIndex, ProviderSlot
from iop_edge.domain.queue import ModelQueue
from iop_edge.domain.session_key import successor_key
from iop_edge.domain.warmth import WarmPolicy
from iop_edge.errors import (
    InvalidRequest,
    ModelNotFound,
    NoProviderAvailable,
    Preempted,
    QueueFull,
    RequestTooLarge,
    ShuttingDown,
    UnsupportedOperation,
)
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import FleetView, RunSpec
from iop_edge.service.backfill import Backfill
from iop_edge.service.limits import RunBody, bound_answer
from iop_edge.service.registry import ProviderRegistry
from iop_edge.service.request_run import RequestRun
from iop_edge.service.runs import UNGUARDED, NodeLink, RunGuards
from iop_edge.service.warm import WarmScheduler
from iop_proto.errors import FrameTooLarge
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE

_NOBODY: frozenset[str] = frozenset()


def _members(index: ModelIndex | None) -> Sequence[ProviderSlot]:
    return () if index is None else index.members


_CACHED_OPERATIONS = frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS})


class Dispatcher:
    """Implements ``RunService``: admits a request as its run, takes a slot for it from
    the registry, sends it on the slot's node link; the run gives the slot back when it
    ends. Owns only the per-model queues and the runs; the pool is the registry's, the
    fleet the holder's."""

    def __init__(
        self,
        fleet: FleetView,
        registry: ProviderRegistry,
        metrics: EdgeMetrics,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        *,
        deadline_grace_s: float,
        guards: RunGuards = UNGUARDED,
        affinity: AffinityPolicy | None = None,
        backfill: Backfill | None = None,
        warm: WarmPolicy | None = None,
    ) -> None:
        self._fleet = fleet
        # Warm-aware selection, for models with providers that load them on demand.
        warm = warm or WarmPolicy()
        self._warm = WarmScheduler(warm, fleet, self.queued, self.slots_changed)
        self._warm_on = warm.enabled
        self._backfill = backfill or Backfill()
        self._affinity = CacheAffinity(affinity or AffinityPolicy())
        # Requests waiting for one provider in particular, the one holding their cache
        # (docs/ARCHITECTURE.md#cache-affinity): served before the model's queue.
        # Each line: (model id, waiter), oldest first.
        self._pinned: dict[str, deque[tuple[str, asyncio.Future[ProviderSlot | None]]]] = {}
        self._guards = guards
        self._stall_only = RunGuards(
            stall_timeout_s=guards.stall_timeout_s,
            first_token_timeout_s=guards.first_token_timeout_s,
        )
        self._registry = registry
        self._deadline_grace_s = deadline_grace_s
        self._stopping: str | None = None  # set by stop_admitting: new runs are refused
        self._failing: str | None = None  # set by fail_all: no run starts any more
        self._became_idle: asyncio.Event | None = None  # while the drain waits
        self._max_frame_size = max_frame_size  # a run that cannot fit is refused (limits)
        self._queues: dict[str, ModelQueue[ProviderSlot | None]] = {}
        self._runs: dict[str, RequestRun] = {}  # by the id of the attempt on its node
        self.runs: Mapping[str, RequestRun] = self._runs  # ``RunView``: read only
        self._waiting: set[RequestRun] = set()  # in a queue, or aside
        # Waiters that are a retry, with the providers they may not go back to.
        self._excluded: dict[asyncio.Future[ProviderSlot | None], frozenset[str]] = {}
        # The run of each waiter in a model's queue (batch lines count against their share).
        self._queued: dict[asyncio.Future[ProviderSlot | None], RequestRun] = {}
        self._metrics = metrics
        metrics.watch_queues(self._queue_lengths)
        registry.subscribe(self)

    # ------------------------------------------------------------ what the registry tells

    def fleet_applied(self, fleet: Fleet) -> None:
        """Queues follow the fleet's models; a removed model's waiters fail, and so do
        those of a model left with no provider at all (its nodes retired, its providers
        dropped): nothing could ever hand them a slot, so they are answered now rather
        than at their queue's timeout. A model whose providers are only unreachable
        keeps its waiters (a node restarting comes back)."""
        for model_id in fleet.models:
            self._queues.setdefault(model_id, ModelQueue(model_id))
        for model_id in list(self._queues):
            if model_id not in fleet.models:
                del self._queues[model_id]
                for run in [r for r in self._waiting if r.model.id == model_id]:
                    run.refuse(NoProviderAvailable("the model was removed"))
                self._metrics.forget_model(model_id)
            elif self._waiting and not _members(self._registry.indexes.get(model_id)):
                message = (
                    f"The model '{model_id}' has no provider any more: the fleet changed"
                    " while this request waited (its nodes retired or its providers removed)"
                )
                for run in [r for r in self._waiting if r.model.id == model_id]:
                    run.refuse(NoProviderAvailable(message))
        self._serve_pinned()
        self._serve_queues(fleet.models)

    def slots_changed(self, model_ids: Iterable[str]) -> None:
        if self._waiting:  # nobody waits: nothing to serve
            self._serve_pinned()
            self._serve_queues(model_ids)

    def link_lost(self, link: NodeLink, reason: str) -> None:
        for run in [r for r in self._runs.values() if r.link is link]:
            run.fail(ErrorCode.PROVIDER_UNAVAILABLE, f"node {link.node_id} lost: {reason}")

    def provider_failed(self, run: RequestRun, failed: Failed) -> None:
        """The node says the run's provider failed it: what that tells of the provider is
        booked before a failover chooses again (``RunOwner``)."""
        if failed.code is ErrorCode.PROVIDER_UNAVAILABLE:
            self._registry.mark_unavailable(run.provider_id)
        elif failed.provider_status == NOT_IMPLEMENTED:
            self._registry.refuse_operation(run.provider_id, run.spec.operation)

    # ------------------------------------------------------------ runs

    def admit(self, spec: RunSpec) -> RequestRun:
        """The request's run, made now, before any wait (it is then the request's one
        owner: ``RequestRun``); ``RequestRun.open`` takes its slot and sends it.

        What can be judged without a slot is judged here: the output cap (a larger
        output length is lowered to it), the fields that multiply the answer's size
        (``bound_answer``), and the run's frame, serialised once and measured (``RunBody``).
        """
        if self._stopping is not None:
            raise ShuttingDown(self._stopping)
        model = self._fleet.current.models.get(spec.model)
        if model is None:
            raise ModelNotFound(f"The model '{spec.model}' does not exist", param="model")
        # The HTTP pipeline has clamped already (and said so in a header); a batch line
        # is clamped here, by the same rule.
        chat, _ = bound_answer(spec.operation, spec.body, model.max_output_tokens)
        body = RunBody(chat, model.providers.values(), self._max_frame_size)
        # The model's providers that do not offer the operation, which it may not go to;
        # when that is all of them, the request is refused before any queue.
        index = self._registry.indexes.get(spec.model)
        lacking = None if index is None else index.lacking.get(spec.operation)
        if index is None or lacking is None:  # all offer it
            lacking = _NOBODY
        elif not index.offers(spec.operation):
            raise UnsupportedOperation(
                f"The model '{spec.model}' does not offer {spec.operation.value}: none of its"
                " providers does",
                param="model",
            )
        if not spec.pin:
            return RequestRun(self, spec, body, model, lacking, asyncio.get_running_loop())
        others = pinned(spec, () if index is None else index.members)
        run = RequestRun(self, spec, body, model, lacking | others, asyncio.get_running_loop())
        run.exclude = others  # a retry stays on the pinned provider too (or fails)
        return run

    async def open_run(self, spec: RunSpec) -> RequestRun:
        """``admit`` and ``RequestRun.open``: the run, dispatched."""
        run = self.admit(spec)
        await run.open()
        return run

    async def reopen(self, run: RequestRun, failed: Failed) -> None:
        """The next attempt of a run whose attempt ``failed`` before its first byte: a
        provider of the model outside ``run.exclude``, taken as any request takes one
        (FIFO, maybe after a wait in the queue) by the run's deadline.

        Raises ``NoProviderAvailable`` when no other provider is usable, and what a
        first attempt raises (``QueueFull``, ``QueueTimeout``, ``ShuttingDown`` ...):
        the run then ends with the failure it had. A draining edge starts nothing new.
        """
        spec = run.spec
        if self._stopping is not None:
            raise ShuttingDown(self._stopping)
        model = self._fleet.current.models.get(spec.model)
        index = self._registry.indexes.get(spec.model)
        exclude = run.exclude
        if index is not None and (lacking := index.lacking.get(spec.operation)):
            exclude = exclude | lacking  # also what it learnt from the failed attempt's 501
        if model is None or index is None or not index.any_usable_except(exclude):
            raise NoProviderAvailable(f"No other provider of '{spec.model}' is available")
        self._metrics.count_retry(model.id, run.provider_id)
        await self.attempt(run, model, exclude, run.deadline)

    async def attempt(
        self,
        run: RequestRun,
        model: ModelEntry,
        exclude: frozenset[str],
        deadline: float | None,
    ) -> None:
        """Take a slot for the run and send it an attempt (``RunOwner``). The slot is the
        run's from the moment it has it: whatever fails from there, the run's end gives
        it back. A node link that fails under the send makes an attempt that failed
        (``provider_unavailable``), which the run fails over from like any other."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        spec = run.spec
        index = self._registry.indexes.get(model.id)
        if index is None:  # the fleet's models and the registry's indexes change together
            raise NoProviderAvailable(f"No provider of '{model.id}' is available right now")
        # The request's prompt prefix as block hashes (``iop_proto.prefix``) steers cache
        # affinity when there is a choice for it to steer: a model with one provider
        # hashes nothing for it. (Hashed once, by the body: the order carries them too.)
        chain: Sequence[int] = ()
        if (
            len(index.members) > 1
            and self._affinity.policy.enabled
            and spec.operation in _CACHED_OPERATIONS
        ):
            chain = run.body.prompt_blocks()
        slotless = spec.operation is Operation.COUNT_TOKENS
        if slotless:
            # Work that takes no slot and waits in no queue (the node asks the engine's
            # tokenizer beside its generations): the least loaded usable provider.
            least = index.least_loaded(exclude)
            if least is None:
                raise NoProviderAvailable(f"No provider of '{model.id}' is available right now")
            slot = least
        else:
            slot = run.slot = await self._acquire(model, index, run, chain, exclude, deadline)
            if spec.batch:
                self._backfill.took(run)
        # The fleet of now, not the one the request was admitted under: a `config reload`
        # that renamed the provider's served name while the request waited sends the new
        # name (the node has the new one too: its config comes on the same link, first).
        fleet = self._fleet.current
        current = fleet.models.get(model.id)
        served = None if current is None else current.providers.get(slot.provider_id)
        entry = fleet.providers.get(slot.provider_id)
        if served is None or entry is None:  # left the model while this request waited
            raise NoProviderAvailable(
                f"provider {slot.provider_id} left '{model.id}'", code="provider_unavailable"
            )
        if self._failing is not None:  # handed its slot just before fail_all: a 503 instead
            raise ShuttingDown(self._failing)
        link = self._registry.links.get(slot.node_id)
        if link is None:  # the node left while this request waited for the slot
            raise NoProviderAvailable(f"node {slot.node_id} is gone", code="provider_unavailable")
        timeout_s = (entry.request_timeout_ms or 600_000) / 1000
        if deadline is not None and deadline - loop.time() < timeout_s:
            timeout_s = deadline - loop.time()  # a retry ends when the request's time does
        now_ms = time.time_ns() // 1_000_000
        # the target rewrite, here and only here (docs/ARCHITECTURE.md#target-rewrite)
        body_json, prepared, blocks = run.body.for_provider(
            entry.type, served, spec.operation, spec.stream
        )
        order = RunOrder(
            run_id=secrets.token_hex(16),  # 32 hex digits, like uuid4().hex
            model=model.id,
            provider_id=slot.provider_id,
            adapter=entry.type,
            target=served,
            operation=spec.operation,
            body_json=body_json,
            stream=spec.stream,
            deadline_unix_ms=now_ms + int(timeout_s * 1000),
            include_usage=spec.include_usage,
            drill=spec.drill,
            body_prepared=prepared,
            prompt_blocks=blocks,
            traceparent=spec.traceparent,
        )
        # a node of an older version never acknowledges: its runs get no ack guard
        guards = self._guards if link.acknowledges_runs else self._stall_only
        run.attempt(order, link, guards, timeout_s, self._deadline_grace_s, now_ms)
        self._runs[order.run_id] = run
        # Where the request went, for cache affinity: its session, the key its successor
        # names (Responses: the first attempt's id is the response's), its prefix. A
        # request that names none of them leaves nothing to remember.
        chained = spec.chained and deadline is None
        if not slotless and (spec.session is not None or chained or chain):
            also = successor_key(run.run_id, spec.scope) if chained else None
            self._affinity.placed(model.id, slot, spec.session, chain, started, also)
        run.edge_queue_wait_s = loop.time() - started
        try:
            await link.send_run(order)
        except ConnectionError as exc:
            message = f"node {slot.node_id} unreachable: {exc}"
            run.fail_send(Failed(ErrorCode.PROVIDER_UNAVAILABLE, message))
        except FrameTooLarge as exc:
            run.unsent()
            raise RequestTooLarge(
                f"The request is too large: its run takes {exc.length} bytes on its way to "
                f"the provider, over this server's limit of {exc.maximum} bytes."
            ) from exc
        else:
            run.order_sent(order.run_id)

    async def _acquire(
        self,
        model: ModelEntry,
        index: ModelIndex,
        run: RequestRun,
        chain: Sequence[int],
        exclude: frozenset[str],
        deadline: float | None,
    ) -> ProviderSlot:
        """A slot for the run, maybe after a wait aside or in the model's queue; the
        wait is the run's (``RequestRun.wait``): ending the run ends it."""
        spec = run.spec
        batch = spec.batch
        queue = self._queues[model.id]
        # Nobody overtakes a waiter of its own class (and batch waits behind all); a batch
        # line past its share of the model's slots waits (``Backfill``).
        # (With nobody waiting anywhere, nobody is overtaken.)
        overtakes = bool(self._waiting) and (len(queue) > 0 if batch else queue.interactive > 0)
        if batch and not self._backfill.room(model.id, index.members):
            overtakes = True
        if not overtakes and (spec.session is not None or chain):
            loop = asyncio.get_running_loop()
            now = loop.time()
            preference = self._affinity.prefer(
                model.id, index.members, spec.session, chain, now, exclude
            )
            if preference is None and spec.session is not None and not model.preference:
                # A new session: where every edge would start it (nothing to reuse yet);
                # under an operator's preference, where it says (index.select, below).
                preference = self._affinity.rendezvous(index.members, spec.session, now, exclude)
            if preference is not None:
                if preference.slot.has_free_slot:
                    preference.slot.take()
                    self._metrics.count_affinity(model.id, preference.reason)
                    return preference.slot
                # Batch lines never wait aside: they would go before interactive waiters.
                if not batch and preference.wait_s > 0:
                    waited = await self._wait_for(run, preference, index, exclude, deadline)
                    decision = "wait_expired" if waited is None else "waited"
                    self._metrics.count_affinity(model.id, decision)
                    if waited is not None:
                        return waited
                    if self._queues.get(model.id) is not queue:  # removed while it waited
                        raise NoProviderAvailable("the model was removed")
                overtakes = queue.interactive > 0  # others may have queued meanwhile
                if batch and not self._backfill.room(model.id, index.members):
                    overtakes = True
        slot = None if overtakes else self._select(index, exclude)
        if slot is not None:
            slot.take()
            return slot
        if not (index.any_usable_except(exclude) if exclude else index.any_usable):
            raise NoProviderAvailable(f"No provider of '{model.id}' is available right now")
        max_queue, timeout_s = self._fleet.current.queue_limits(model.id)
        loop = asyncio.get_running_loop()
        if deadline is not None:  # a retry: within what is left of the request's time
            timeout_s = min(timeout_s, deadline - loop.time())
        # Each class has its own room: batch lines never take an interactive place.
        if self._stopping is not None:  # back from a wait aside after the drain began
            raise ShuttingDown(self._stopping)
        if index.loaders and len(queue) >= max_queue:
            self._serve_queues((model.id,))  # held for a load: a full queue spreads instead
        if (queue.batch if batch else queue.interactive) >= max_queue:
            raise QueueFull(f"The queue of '{model.id}' is full ({max_queue} waiting); retry later")
        waiter: asyncio.Future[ProviderSlot | None] = loop.create_future()
        queue.push(waiter, batch=batch, share=spec.share)
        self._queued[waiter] = run
        if exclude:
            self._excluded[waiter] = exclude
        self._waiting.add(run)

        def leave() -> None:
            queue.remove(waiter)
            self._queued.pop(waiter, None)
            self._excluded.pop(waiter, None)
            self._waiting.discard(run)
            self._check_idle()

        message = f"No provider of '{model.id}' had a free slot within {timeout_s * 1000:.0f} ms"
        run.wait(waiter, leave, (timeout_s, message))
        if self._excluded:  # a retry waiting ahead may leave a free slot to this one
            self._serve_queues((model.id,))
        elif not batch and (victim := self._backfill.victim(model.id, queue.interactive)):
            # A batch line of the model yields its slot to this request (preemption): its
            # end gives the slot back, and the queue hands it on, interactive first.
            reason = "preempted by an interactive request"
            self._metrics.count_preemption(model.id)
            await asyncio.shield(victim.cancel(reason, Preempted(reason)))
        slot = await waiter
        run.placed()
        assert slot is not None  # a queue hands slots (the run's end raises instead)
        return slot

    async def _wait_for(
        self,
        run: RequestRun,
        preference: Preference,
        index: ModelIndex,
        exclude: frozenset[str],
        deadline: float | None,
    ) -> ProviderSlot | None:
        """Wait for a slot of the provider holding the request's cache; ``None``: the wait
        is over, or the provider stopped being a candidate, and the request takes what the
        seed's rule gives it. The wait counts in the provider's load for the bounded-load
        rule.

        The wait is ``preference.wait_s`` (the re-prefill it saves) at a time, renewed
        while no other provider has a free slot when it runs out (the request would only
        queue for one: waiting for its cache costs nothing more), and never past
        ``max_wait_s`` in all, nor the retry's ``deadline``."""
        loop = asyncio.get_running_loop()
        limit = loop.time() + self._affinity.policy.max_wait_s
        if deadline is not None:
            limit = min(limit, deadline)
        provider_id = preference.slot.provider_id
        others = exclude | {provider_id}
        waiter: asyncio.Future[ProviderSlot | None] = loop.create_future()
        line = self._pinned.setdefault(provider_id, deque())
        entry = (run.model.id, waiter)
        line.append(entry)
        self._affinity.waiting(provider_id, 1)
        self._waiting.add(run)

        def leave() -> None:
            self._affinity.waiting(provider_id, -1)
            if entry in line:
                line.remove(entry)
            if not line and self._pinned.get(provider_id) is line:
                del self._pinned[provider_id]
            self._waiting.discard(run)
            self._check_idle()

        run.wait(waiter, leave)
        while (chunk_s := min(preference.wait_s, limit - loop.time())) > 0:
            # asyncio.wait, not a timeout around the await: that would cancel the
            # waiter with the first chunk, and it must outlive it.
            await asyncio.wait((waiter,), timeout=chunk_s)
            if waiter.done():
                slot = waiter.result()  # raises what ended the run meanwhile
                run.placed()
                return slot
            if index.select(others) is not None:
                break  # a free slot elsewhere: the re-prefill's worth is spent
        run.placed()
        return None

    def _serve_pinned(self, only: ProviderSlot | None = None) -> None:
        """Hand free slots to the requests waiting for their provider in particular;
        wake those whose provider stopped being a candidate, or left their model (they go
        the seed's way, or learn that the model is gone)."""
        models = self._fleet.current.models
        for provider_id, line in list(self._pinned.items()):
            if only is not None and provider_id != only.provider_id:
                continue
            slot = only or self._registry.slot(provider_id)
            usable = slot is not None and slot.usable
            for model_id, waiter in [e for e in line if not e[1].done()]:
                model = models.get(model_id)
                if not usable or model is None or provider_id not in model.providers:
                    line.remove((model_id, waiter))
                    waiter.set_result(None)
            while line and slot is not None and usable and slot.has_free_slot:
                _, waiter = line.popleft()
                if waiter.done():
                    continue
                slot.take()
                waiter.set_result(slot)

    def attempt_over(self, run: RequestRun, outcome: Completed | Failed) -> None:
        """The run's attempt ended: it leaves the runs in flight, its outcome is booked
        (before the slot is offered), its slot goes back, and then what the node's end
        said of the provider's load (``ProviderLoad``) is the pool's."""
        self._runs.pop(run.attempt_id, None)
        freed = self._registry.record_outcome(
            run.provider_id, outcome, drill=run.spec.drill, release=run.slot is not None
        )
        if run.spec.batch:
            self._backfill.gave_back(run)
        if run.unacknowledged:  # the node, not the provider, is in doubt
            self._registry.node_unresponsive(run.node_id, f"run {run.attempt_id} unacknowledged")
        if self._warm.tracking:
            completed = isinstance(outcome, Completed)
            self._warm.ended(run.model.id, run.provider_id, completed, answered=run.answered)
        if freed is not None and self._waiting:  # nobody waits: nothing to serve
            self._serve_freed(freed)
        if outcome.load is not None:  # the node's count after the run: the one kept
            self._registry.apply_load(run.node_id, run.provider_id, outcome.load)
        if self._became_idle is not None:
            self._check_idle()

    def first_delta(self, run: RequestRun) -> None:
        """The attempt's first delta (``RunOwner``): a provider that was loading the model
        holds it now, so the requests held for that load go at once, to its free slots,
        rather than when the loading run ends (docs/ARCHITECTURE.md#warm-aware-scheduling)."""
        if not self._warm.tracking:
            return
        if self._warm.answered(run.model.id, run.provider_id) and self._waiting:
            self._serve_queues((run.model.id,))

    def release(self, slot: ProviderSlot, run: RequestRun) -> None:
        """A slot a run held without an attempt on it (``RunOwner``)."""
        slot.release()
        if run.spec.batch:
            self._backfill.gave_back(run)
        if self._waiting:
            self._serve_freed(slot)
        self._check_idle()

    def _serve_freed(self, slot: ProviderSlot) -> None:
        """A place of ``slot`` went back: to whoever waits for it (aside or in a queue)."""
        if self._pinned:
            self._serve_pinned(slot)
        self._serve_queues(slot.model_ids() if slot.warmth is None else self._warm.order(slot))

    def _select(self, index: ModelIndex, exclude: Container[str] = _NOBODY) -> ProviderSlot | None:
        """The model's provider for its next request: the heap's, unless some provider of
        the model loads it on demand (docs/ARCHITECTURE.md#warm-aware-scheduling)."""
        if index.loaders and self._warm_on:
            return self._warm.select(index, exclude)
        return index.select(exclude)

    def _serve_queues(self, model_ids: Iterable[str]) -> None:
        """Hand free slots to these models' queues in their order (``ModelQueue``: by
        class, then the keys' turns, FIFO within a key), batch lines within their share."""
        for model_id in model_ids:
            queue = self._queues.get(model_id)
            index = self._registry.indexes.get(model_id)
            if not queue or index is None:
                continue
            while queue:
                batch_room = self._backfill.room(model_id, index.members)
                if self._excluded:
                    waiter, slot = self._servable(queue, index, batch_room)
                else:
                    slot = self._select(index)
                    waiter = None if slot is None else queue.pop_waiting(batch=batch_room)
                if waiter is None or slot is None:
                    break
                slot.take()
                run = self._queued.get(waiter)
                if run is not None and run.spec.batch:
                    self._backfill.took(run)
                waiter.set_result(slot)

    def _servable(
        self, queue: ModelQueue[ProviderSlot | None], index: ModelIndex, batch_room: bool
    ) -> tuple[asyncio.Future[ProviderSlot | None] | None, ProviderSlot | None]:
        """The first waiter (in the queue's order) that may take a free slot, and that
        slot: a retry that may not go back to the providers with one lets the next take
        it; a batch line past its share lets it too."""
        if index.select() is None:
            return None, None
        for waiter in queue:
            if waiter.done():
                continue
            run = self._queued.get(waiter)
            if not batch_room and run is not None and run.spec.batch:
                continue
            slot = self._select(index, self._excluded.get(waiter, _NOBODY))
            if slot is not None:
                queue.remove(waiter)
                return waiter, slot
        return None, None

    def stop_admitting(self, reason: str) -> None:
        """The edge is draining: runs in flight go on, nothing new starts. A run still
        waiting for a slot (in its model's queue, or aside for its cache's provider)
        ends with its retryable 503 now: started later it would only be cut at the
        drain's end."""
        self._stopping = reason
        for run in list(self._waiting):
            run.refuse(ShuttingDown(reason))

    @property
    def idle(self) -> bool:
        """No run in flight, no slot taken (a waiter handed one is about to start its run)
        and nobody waiting for a slot: the drain is over."""
        return (
            not self._runs
            and not any(self._queues.values())
            and not self._pinned
            and not any(slot.own_in_flight for slot in self._registry.slots())
        )

    async def wait_idle(self) -> None:
        """Return once ``idle`` (the drain bounds this with its timeout)."""
        if not self.idle:
            self._became_idle = asyncio.Event()
            await self._became_idle.wait()

    def _check_idle(self) -> None:
        if self._became_idle is not None and self.idle:
            self._became_idle.set()

    async def fail_all(self, reason: str) -> None:
        """The edge is stopping: end every run (its stream gets an error event) and every
        waiting one (a 503), also one handed a slot whose attempt has not started yet."""
        self.stop_admitting(reason)  # first: waiters end, a slot a run frees goes to nobody
        self._failing = reason
        for run in list(self._runs.values()):
            await run.cancel(reason)

    def close(self) -> None:
        """Stop the warm-aware holds' timers (the edge is stopping)."""
        self._warm.close()

    def _queue_lengths(self) -> list[tuple[str, int]]:
        """Each model's waiters, for ``iop_edge_model_queued`` (read at scrape time)."""
        return [(model_id, len(queue)) for model_id, queue in self._queues.items()]

    def queued(self, model_id: str) -> int:
        queue = self._queues.get(model_id)
        return len(queue) if queue else 0

    def runs_in_flight(self) -> int:
        return len(self._runs)


def pinned(spec: RunSpec, members: Sequence[ProviderSlot]) -> frozenset[str]:
    """The providers of the model a pinned request may not go to (``domain.pin``)."""
    try:
        return pinned_out(spec.pin, members)
    except PinUnknown:
        raise InvalidRequest(
            f"The provider '{spec.pin}' does not serve the model '{spec.model}'.", param="model"
        ) from None
