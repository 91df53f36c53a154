"""Dispatch: the model id stays the key until the last moment, then a provider is
chosen (docs/ARCHITECTURE.md#selection), the target rewritten to its served name
(docs/ARCHITECTURE.md#target-rewrite), and the run sent to its node.

Owns the per-model FIFO queues and the runs in flight, nothing else: the pool
and the node links are the ``ProviderRegistry``'s, the fleet the ``FleetHolder``'s.
Every slot taken is released exactly once, by the run's end, and every release
(and every change the registry reports) first serves the queues of the models
it can serve. A run that fails before its first byte is opened again here, on
another provider (``reopen``, for ``FailoverRun``: docs/ARCHITECTURE.md#failover).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Iterable, Sequence

from iop_edge.domain.affinity import AffinityPolicy, CacheAffinity, Preference
from iop_edge.domain.events import (
    NOT_IMPLEMENTED,
    Accepted,
    ErrorCode,
    Failed,
    RunEvent,
    RunOrder,
)
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation
from iop_edge.domain.pool import ModelIndex, ProviderSlot
from iop_edge.domain.queue import ModelQueue
from iop_edge.domain.session_key import successor_key
from iop_edge.errors import (
    EdgeError,
    ModelNotFound,
    NoProviderAvailable,
    QueueFull,
    QueueTimeout,
    RequestTooLarge,
    ShuttingDown,
    UnsupportedOperation,
)
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import FleetView, RunSpec
from iop_edge.service.failover import FailoverRun
from iop_edge.service.limits import (
    RunBody,
    check_answer_size,
    check_run_frame,
    clamp_output_tokens,
)
from iop_edge.service.registry import ProviderRegistry
from iop_edge.service.runs import UNGUARDED, EdgeRun, NodeLink, RunGuards
from iop_proto.errors import FrameTooLarge
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE

_NOBODY: frozenset[str] = frozenset()
_CACHED_OPERATIONS = frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS})


class Dispatcher:
    """Implements ``RunService``: acquires a slot from the registry, starts the run on
    the slot's node link, releases the slot when the run ends. Owns only the per-model
    queues and the runs in flight; the pool is the registry's, the fleet the holder's."""

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
    ) -> None:
        self._fleet = fleet
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
        self._queues: dict[str, ModelQueue[ProviderSlot]] = {}
        self._runs: dict[str, EdgeRun] = {}
        # Waiters that are a retry, with the providers they may not go back to.
        self._excluded: dict[asyncio.Future[ProviderSlot], frozenset[str]] = {}
        self._metrics = metrics
        registry.subscribe(self)

    # ------------------------------------------------------------ what the registry tells

    def fleet_applied(self, fleet: Fleet) -> None:
        """Queues follow the fleet's models; a removed model's waiters fail."""
        for model_id in fleet.models:
            self._queues.setdefault(model_id, ModelQueue(model_id))
        for model_id in list(self._queues):
            if model_id not in fleet.models:
                self._fail_waiters(self._queues.pop(model_id), "the model was removed")
                self._metrics.forget_model(model_id)
        self._serve_pinned()
        self._serve_queues(fleet.models)

    def slots_changed(self, model_ids: Iterable[str]) -> None:
        self._serve_pinned()
        self._serve_queues(model_ids)

    def link_lost(self, link: NodeLink, reason: str) -> None:
        for run in [r for r in self._runs.values() if r.link is link]:
            run.fail(ErrorCode.PROVIDER_UNAVAILABLE, f"node {link.node_id} lost: {reason}")

    def deliver(self, run_id: str, event: RunEvent | Accepted) -> bool:
        """Route a node's run event to its run; False for an unknown run id."""
        run = self._runs.get(run_id)
        if run is None:
            return False
        if type(event) is Failed:
            if event.code is ErrorCode.PROVIDER_UNAVAILABLE:
                self._registry.mark_unavailable(run.provider_id)
            elif event.provider_status == NOT_IMPLEMENTED:  # before a failover chooses again
                self._registry.refuse_operation(run.provider_id, run.request.operation)
        run.deliver(event)
        return True

    def run(self, run_id: str) -> EdgeRun | None:
        """The run in flight with this id (``RunView``)."""
        return self._runs.get(run_id)

    # ------------------------------------------------------------ runs

    async def open_run(self, spec: RunSpec) -> FailoverRun:
        """Check the request, take a slot (maybe after a wait in the model's queue), send.

        What can be judged without a slot is judged first: the output cap (a larger
        output length is lowered to it), the fields that multiply the answer's size
        (``check_answer_size``), and the run's frame, serialised once and measured.
        From the slot taken to the node having the run, any failure at all (an error,
        a cancellation) gives the slot back, leaves no run behind and tells a node that
        may have the run to drop it.
        A node link that fails under the send makes an attempt that failed
        (``provider_unavailable``), which the run fails over from like any other.
        """
        if self._stopping is not None:
            raise ShuttingDown(self._stopping)
        model = self._fleet.current.models.get(spec.model)
        if model is None:
            raise ModelNotFound(f"The model '{spec.model}' does not exist", param="model")
        # The HTTP pipeline has clamped already (and said so in a header); a batch line
        # is clamped here, by the same rule.
        chat, _ = clamp_output_tokens(spec.operation, spec.body, model.max_output_tokens)
        check_answer_size(spec.operation, chat)
        body = RunBody.encode(chat)
        check_run_frame(body, model, self._max_frame_size)
        first = await self._open_attempt(model, spec, body, self._lacking(spec), None)
        return FailoverRun(self, spec, body, first, model.retries)

    def _lacking(self, spec: RunSpec) -> frozenset[str]:
        """The model's providers that do not offer the request's operation, which it may
        not go to; ``UnsupportedOperation`` when that is all of them (before any queue)."""
        index = self._registry.index(spec.model)
        lacking = None if index is None else index.lacking.get(spec.operation)
        if index is None or lacking is None:  # all offer it: the one lookup of the common case
            return _NOBODY
        if not index.offers(spec.operation):
            raise UnsupportedOperation(
                f"The model '{spec.model}' does not offer {spec.operation.value}: none of its"
                " providers does",
                param="model",
            )
        return lacking

    async def reopen(
        self,
        spec: RunSpec,
        body: RunBody,
        exclude: frozenset[str],
        deadline: float,
        failed: EdgeRun,
    ) -> EdgeRun:
        """The next attempt of a run whose attempt ``failed`` failed before its first byte
        (``FailoverRun``): a provider of the model outside ``exclude``, taken as any
        request takes one (FIFO, maybe after a wait in the queue) by ``deadline``.

        Raises ``NoProviderAvailable`` when no other provider is usable, and what
        ``open_run`` raises (``QueueFull``, ``QueueTimeout``, ``ShuttingDown`` ...):
        the run then ends with the failure it had. A draining edge starts nothing new.
        """
        if self._stopping is not None:
            raise ShuttingDown(self._stopping)
        model = self._fleet.current.models.get(spec.model)
        index = self._registry.index(spec.model)
        if index is not None and (lacking := index.lacking.get(spec.operation)):
            exclude = exclude | lacking  # also what it learnt from the failed attempt's 501
        if model is None or index is None or not index.any_usable_except(exclude):
            raise NoProviderAvailable(f"No other provider of '{spec.model}' is available")
        self._metrics.count_retry(model.id, failed.provider_id)
        return await self._open_attempt(model, spec, body, exclude, deadline)

    async def _open_attempt(
        self,
        model: ModelEntry,
        spec: RunSpec,
        body: RunBody,
        exclude: frozenset[str],
        deadline: float | None,
    ) -> EdgeRun:
        loop = asyncio.get_running_loop()
        started = loop.time()
        slotless = spec.operation is Operation.COUNT_TOKENS
        chain = self._chain(spec, body)
        if slotless:
            slot = self._least_loaded(model, exclude)
        else:
            slot = await self._acquire(model, spec, chain, exclude, deadline)
        run: EdgeRun | None = None
        try:
            run = self._start(model, slot, spec, body, deadline, loop)
            if not slotless:
                # The first attempt's id is the response's (Responses): its successor's key.
                also = (
                    successor_key(run.run_id, spec.scope)
                    if spec.chained and deadline is None
                    else None
                )
                self._affinity.placed(model.id, slot, spec.session, chain, started, also)
            run.edge_queue_wait_s = loop.time() - started
            await run.send()
        except BaseException as exc:
            # The one way back: the run ends here (its slot released exactly once), or,
            # with no run made yet, the slot itself goes back.
            if run is None:
                if not slotless:
                    self._release(slot)
            else:
                reason = f"not dispatched: {type(exc).__name__}"
                if isinstance(exc, ConnectionError):
                    message = f"node {slot.node_id} unreachable: {exc}"
                    failure = Failed(ErrorCode.PROVIDER_UNAVAILABLE, message)
                    await run.abandon(reason, sent=True, failure=failure)
                    return run
                await run.abandon(reason, sent=not isinstance(exc, FrameTooLarge))
            refusal = _refusal(exc)
            if refusal is None:
                raise
            raise refusal from exc
        return run

    def _least_loaded(self, model: ModelEntry, exclude: frozenset[str]) -> ProviderSlot:
        """A provider for work that takes no slot and waits in no queue (``count_tokens``:
        the node asks the engine's tokenizer beside its generations): the least loaded
        usable one, free slot or not."""
        index = self._registry.index(model.id)
        slot = None if index is None else index.least_loaded(exclude)
        if slot is None:
            raise NoProviderAvailable(f"No provider of '{model.id}' is available right now")
        return slot

    def _chain(self, spec: RunSpec, body: RunBody) -> Sequence[int]:
        """The request's prompt prefix as block hashes (``iop_proto.prefix``), when there
        is a choice for it to steer: a model with one provider hashes nothing."""
        if not self._affinity.policy.enabled or spec.operation not in _CACHED_OPERATIONS:
            return ()
        index = self._registry.index(spec.model)
        if index is None or len(index.members) < 2:
            return ()
        return body.prompt_blocks()  # hashed once: the order carries them to the node

    async def _acquire(
        self,
        model: ModelEntry,
        spec: RunSpec,
        chain: Sequence[int],
        exclude: frozenset[str] = _NOBODY,
        deadline: float | None = None,
    ) -> ProviderSlot:
        batch = spec.batch
        queue = self._queues[model.id]
        index = self._registry.index(model.id)
        assert index is not None  # the registry indexes every model of the fleet
        # FIFO: nobody overtakes a waiter of its own class (and batch waits behind all).
        overtakes = len(queue) > 0 if batch else queue.interactive > 0
        if not overtakes and (spec.session is not None or chain):
            loop = asyncio.get_running_loop()
            preference = self._affinity.prefer(
                model.id, index.members, spec.session, chain, loop.time(), exclude
            )
            if preference is not None:
                if preference.slot.has_free_slot:
                    preference.slot.take()
                    self._metrics.publish_slot(preference.slot)
                    self._metrics.count_affinity(model.id, preference.reason)
                    return preference.slot
                # Batch lines never wait aside: they would go before interactive waiters.
                if not batch and preference.wait_s > 0:
                    waited = await self._wait_for(model.id, preference, index, exclude, deadline)
                    decision = "wait_expired" if waited is None else "waited"
                    self._metrics.count_affinity(model.id, decision)
                    if waited is not None:
                        return waited
                    if self._queues.get(model.id) is not queue:  # removed while it waited
                        raise NoProviderAvailable("the model was removed")
                overtakes = queue.interactive > 0  # others may have queued meanwhile
        slot = None if overtakes else index.select(exclude)
        if slot is not None:
            slot.take()
            self._metrics.publish_slot(slot)
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
        if (queue.batch if batch else queue.interactive) >= max_queue:
            raise QueueFull(f"The queue of '{model.id}' is full ({max_queue} waiting); retry later")
        waiter: asyncio.Future[ProviderSlot] = loop.create_future()
        queue.push(waiter, batch=batch)
        if exclude:
            self._excluded[waiter] = exclude
        if self._excluded:  # a retry waiting ahead may leave a free slot to this one
            self._serve_queues((model.id,))
        self._metrics.publish_queued(model.id, len(queue))
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed a slot as we gave up: pass it on
            else:
                waiter.cancel()
                queue.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(
                    f"No provider of '{model.id}' had a free slot within {timeout_s * 1000:.0f} ms"
                ) from None
            raise
        finally:
            if exclude:
                del self._excluded[waiter]
            if self._queues.get(model.id) is queue:  # else the model was removed meanwhile
                self._metrics.publish_queued(model.id, len(queue))
            self._check_idle()

    async def _wait_for(
        self,
        model_id: str,
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
        entry = (model_id, waiter)
        line.append(entry)
        self._affinity.waiting(provider_id, 1)
        try:
            while (chunk_s := min(preference.wait_s, limit - loop.time())) > 0:
                # asyncio.wait, not a timeout around the await: that would cancel the
                # waiter with the first chunk, and it must outlive it.
                await asyncio.wait((waiter,), timeout=chunk_s)
                if waiter.done():
                    return waiter.result()
                if index.select(others) is not None:
                    return None  # a free slot elsewhere: the re-prefill's worth is spent
            return None
        except BaseException:
            handed = waiter.done() and not waiter.cancelled() and waiter.exception() is None
            if handed and (slot := waiter.result()) is not None:
                self._release(slot)  # handed a slot as we gave up: pass it on
            raise
        finally:
            waiter.cancel()  # a no-op once done; else nobody hands it a slot any more
            self._affinity.waiting(provider_id, -1)
            if entry in line:
                line.remove(entry)
            if not line and self._pinned.get(provider_id) is line:
                del self._pinned[provider_id]
            self._check_idle()

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
                self._metrics.publish_slot(slot)
                waiter.set_result(slot)

    def _start(
        self,
        model: ModelEntry,
        slot: ProviderSlot,
        spec: RunSpec,
        body: RunBody,
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> EdgeRun:
        served = model.providers[slot.provider_id]
        entry = self._fleet.current.providers[slot.provider_id]
        if self._failing is not None:  # handed its slot just before fail_all: a 503 instead
            raise ShuttingDown(self._failing)
        link = self._registry.link(slot.node_id)
        if link is None:  # the node left while this request waited for the slot
            raise NoProviderAvailable(f"node {slot.node_id} is gone", code="provider_unavailable")
        run_id = secrets.token_hex(16)  # 32 hex digits, like uuid4().hex, for less work
        timeout_s = (entry.request_timeout_ms or 600_000) / 1000
        now = loop.time()
        if deadline is not None and deadline - now < timeout_s:
            timeout_s = deadline - now  # a retry ends when the request's time does
        now_ms = time.time_ns() // 1_000_000
        # the target rewrite, here and only here (docs/ARCHITECTURE.md#target-rewrite)
        body_json, prepared, blocks = body.for_provider(
            entry.type, served, spec.operation, spec.stream
        )
        request = RunOrder(
            run_id=run_id,
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
        )
        run = EdgeRun(
            run_id,
            request,
            slot.provider_id,
            link,
            served,
            now + timeout_s,
            self._run_finished,
            self._deadline_grace_s,
            now_ms,
            # a node of an older version never acknowledges: its runs get no ack guard
            self._guards if link.acknowledges_runs else self._stall_only,
            loop,  # the caller's: each get_running_loop() is a getpid on Python 3.11
        )
        self._runs[run_id] = run
        return run

    def _run_finished(self, run: EdgeRun) -> None:
        self._runs.pop(run.run_id, None)
        # before the slot is offered
        self._registry.record_outcome(run.provider_id, run.outcome, drill=run.request.drill)
        if run.unacknowledged:  # the node, not the provider, is in doubt
            self._registry.node_unresponsive(run.node_id, f"run {run.run_id} unacknowledged")
        slot = self._registry.slot(run.provider_id)
        if slot is not None and run.request.operation is not Operation.COUNT_TOKENS:
            self._release(slot)
        self._check_idle()

    def _release(self, slot: ProviderSlot) -> None:
        slot.release()
        self._metrics.publish_slot(slot)
        if self._pinned:
            self._serve_pinned(slot)
        self._serve_queues(slot.model_ids())

    def _serve_queues(self, model_ids: Iterable[str]) -> None:
        """Hand free slots to the heads of these models' queues, FIFO, interactive first."""
        for model_id in model_ids:
            queue = self._queues.get(model_id)
            index = self._registry.index(model_id)
            if not queue or index is None:
                continue
            while queue:
                if self._excluded:
                    waiter, slot = self._servable(queue, index)
                else:
                    slot = index.select()
                    waiter = None if slot is None else queue.pop_waiting()
                if waiter is None or slot is None:
                    break
                slot.take()
                self._metrics.publish_slot(slot)
                waiter.set_result(slot)
            self._metrics.publish_queued(model_id, len(queue))

    def _servable(
        self, queue: ModelQueue[ProviderSlot], index: ModelIndex
    ) -> tuple[asyncio.Future[ProviderSlot] | None, ProviderSlot | None]:
        """The first waiter (interactive first) that may take a free slot, and that slot:
        a retry that may not go back to the providers with one lets the next take it."""
        if index.select() is None:
            return None, None
        for waiter in queue:
            if waiter.done():
                continue
            slot = index.select(self._excluded.get(waiter, _NOBODY))
            if slot is not None:
                queue.remove(waiter)
                return waiter, slot
        return None, None

    def _fail_waiters(self, queue: ModelQueue[ProviderSlot], reason: str) -> None:
        while (waiter := queue.pop_waiting()) is not None:
            waiter.set_exception(NoProviderAvailable(reason))

    def stop_admitting(self, reason: str) -> None:
        """The edge is draining: runs in flight go on, nothing new starts. A request still
        waiting for a slot (in its model's queue, or aside for its cache's provider) gets
        its retryable 503 now: started later it would only be cut at the drain's end."""
        self._stopping = reason
        for queue in self._queues.values():
            while (waiter := queue.pop_waiting()) is not None:
                waiter.set_exception(ShuttingDown(reason))
        for line in self._pinned.values():
            for _, pinned in line:
                if not pinned.done():
                    pinned.set_exception(ShuttingDown(reason))

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
        waiter (a 503), also one handed a slot whose run has not started yet."""
        self.stop_admitting(reason)  # first: waiters end, a slot a run frees goes to nobody
        self._failing = reason
        for run in list(self._runs.values()):
            await run.cancel(reason)

    def queued(self, model_id: str) -> int:
        queue = self._queues.get(model_id)
        return len(queue) if queue else 0

    def runs_in_flight(self) -> int:
        return len(self._runs)


def _refusal(exc: BaseException) -> EdgeError | None:
    """The ``EdgeError`` a run that did not reach its node ends with, for what the edge
    understands; ``None``: raise the original (an ``EdgeError`` already, a cancellation,
    or a bug, which the request's boundary answers with a 500 and logs)."""
    if isinstance(exc, FrameTooLarge):
        return RequestTooLarge(
            f"The request is too large: its run takes {exc.length} bytes on its way to "
            f"the provider, over this server's limit of {exc.maximum} bytes."
        )
    return None
