"""Dispatch: the model id stays the key until the last moment (S01), then a provider is
chosen (S04), the target rewritten to its served name (S03), and the run sent to its node.

Owns the live pool (one ``ProviderSlot`` per provider, one ``ModelIndex`` per
model), the per-model FIFO queues and the runs in flight. Every slot taken is
released exactly once, by the run's end, and every release first serves the
queues of the models it can serve. Slot state changes only through the slot's
``take``/``release``/``update``, so the indexes never fall behind.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterable

from iop_edge.domain.fleet import Fleet, ModelEntry, Operation
from iop_edge.domain.pool import (
    AVAILABLE,
    UNAVAILABLE,
    UNKNOWN,
    ModelIndex,
    ProviderSlot,
    index_models,
)
from iop_edge.domain.queue import ModelQueue
from iop_edge.errors import (
    EdgeError,
    ModelNotFound,
    NoProviderAvailable,
    QueueFull,
    QueueTimeout,
    RequestTooLarge,
    ShuttingDown,
)
from iop_edge.limits import RunBody, check_output_tokens, check_run_frame
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.runs import DEADLINE_GRACE_S, EdgeRun, NodeLink
from iop_proto.errors import FrameTooLarge
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.v1 import runtime_pb2 as pb

_OPERATIONS = {
    Operation.CHAT_COMPLETIONS: pb.OPERATION_CHAT_COMPLETIONS,
    Operation.COMPLETIONS: pb.OPERATION_COMPLETIONS,
    Operation.EMBEDDINGS: pb.OPERATION_EMBEDDINGS,
}
_HEALTH = {pb.HEALTH_AVAILABLE: AVAILABLE, pb.HEALTH_UNAVAILABLE: UNAVAILABLE}


class Dispatcher:
    """Implements ``RunService``; the node listener feeds it connections and events."""

    def __init__(
        self,
        metrics: EdgeMetrics,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        deadline_grace_s: float = DEADLINE_GRACE_S,
    ) -> None:
        self.fleet = Fleet()
        self._deadline_grace_s = deadline_grace_s
        self._stopping: str | None = None  # set by stop_admitting: new runs are refused
        self._became_idle: asyncio.Event | None = None  # while the drain waits
        self._max_frame_size = max_frame_size  # a run that cannot fit is refused (limits)
        self.slots: dict[str, ProviderSlot] = {}
        self._indexes: dict[str, ModelIndex] = {}
        self._model_rank: dict[str, int] = {}  # fleet order, in which queues are served
        self.links: dict[str, NodeLink] = {}
        self.queues: dict[str, ModelQueue[ProviderSlot]] = {}
        self.runs: dict[str, EdgeRun] = {}
        self._metrics = metrics

    # ------------------------------------------------------------ fleet and nodes

    def apply_fleet(self, fleet: Fleet) -> None:
        """Swap in a new fleet config; live state of providers that stay is kept."""
        self.fleet = fleet
        for provider_id in list(self.slots):
            if provider_id not in fleet.providers:
                self.slots.pop(provider_id).detach()
                self._metrics.forget_provider(provider_id)
        for entry in fleet.providers.values():
            slot = self.slots.get(entry.id)
            if slot is None:
                slot = self.slots[entry.id] = ProviderSlot(entry.id, entry.node_id)
            slot.node_id, slot.type, slot.category = entry.node_id, entry.type, entry.category
            # connected follows the node, also for a provider moved to another node
            slot.update(capacity=entry.capacity, connected=entry.node_id in self.links)
        slots = self.slots
        self._indexes = index_models(
            ((m.id, [slots[p] for p in m.providers if p in slots]) for m in fleet.models.values()),
            slots.values(),
        )
        self._model_rank = {model_id: rank for rank, model_id in enumerate(fleet.models)}
        for model_id in fleet.models:
            self.queues.setdefault(model_id, ModelQueue(model_id))
        for model_id in list(self.queues):
            if model_id not in fleet.models:
                self._fail_waiters(self.queues.pop(model_id), "the model was removed")
                self._metrics.forget_model(model_id)
        self._serve_queues(fleet.models)

    def node_connected(self, link: NodeLink, providers: Iterable[pb.ProviderState]) -> None:
        self.links[link.node_id] = link
        for slot in self._slots_of_node(link.node_id):
            slot.update(connected=True)
        self.apply_snapshot(link.node_id, providers)

    def node_disconnected(self, link: NodeLink, reason: str) -> None:
        """The node's providers are unavailable at once and the connection's runs end
        with an error (a replaced connection's runs too: nothing else can end them)."""
        if self.links.get(link.node_id) is link:  # else a newer connection replaced it
            del self.links[link.node_id]
            for slot in self._slots_of_node(link.node_id):
                slot.update(connected=False, reported_in_flight=0)
                self._metrics.publish_slot(slot)
        for run in [r for r in self.runs.values() if r.link is link]:
            run.fail(pb.ERROR_CODE_PROVIDER_UNAVAILABLE, f"node {link.node_id} lost: {reason}")

    def apply_snapshot(self, node_id: str, providers: Iterable[pb.ProviderState]) -> None:
        changed: set[str] = set()
        for state in providers:
            slot = self.slots.get(state.provider_id)
            if slot is None or slot.node_id != node_id:
                continue  # not in the fleet (or not this node's): never routable
            slot.update(
                health=_HEALTH.get(state.health, UNKNOWN), reported_in_flight=state.in_flight
            )
            slot.node_queued = state.queued
            slot.models = tuple(state.models)
            slot.detail = state.detail
            caps = state.capabilities
            slot.lifecycle = {
                "list_models": caps.list_models,
                "load_model": caps.load_model,
                "unload_model": caps.unload_model,
                "pull_model": caps.pull_model,
                "delete_model": caps.delete_model,
            }
            self._metrics.publish_slot(slot)
            changed.update(slot.model_ids())
        self._serve_queues(sorted(changed, key=self._model_rank.__getitem__))

    def deliver(self, event: pb.RunEvent) -> bool:
        """Route a node's run event to its run; False for an unknown run id."""
        run = self.runs.get(event.run_id)
        if run is None:
            return False
        if event.WhichOneof("kind") == "error" and (
            event.error.code == pb.ERROR_CODE_PROVIDER_UNAVAILABLE
        ):
            # The node found its provider unreachable: stop routing to it now rather
            # than at the node's next snapshot (which also brings it back when it is).
            slot = self.slots.get(run.provider_id)
            if slot is not None and slot.health == AVAILABLE:
                slot.update(health=UNAVAILABLE)
                self._metrics.publish_slot(slot)
        run.deliver(event)
        return True

    # ------------------------------------------------------------ runs

    async def open_run(self, spec: RunSpec) -> EdgeRun:
        """Check the request, take a slot (maybe after a wait in the model's queue), send.

        What can be judged without a slot is judged first: the output cap, and the
        run's frame, serialised once and measured. From the slot taken to the node
        having the run, any failure at all (an error, a cancellation) gives the slot
        back, leaves no run behind and tells a node that may have the run to drop it.
        """
        if self._stopping is not None:
            raise ShuttingDown(self._stopping)
        model = self.fleet.models.get(spec.model)
        if model is None:
            raise ModelNotFound(f"The model '{spec.model}' does not exist", param="model")
        check_output_tokens(spec.operation, spec.body, model.max_output_tokens)
        body = RunBody.encode(spec.body)
        check_run_frame(body, model, self._max_frame_size)
        loop = asyncio.get_running_loop()
        started = loop.time()
        slot = await self._acquire(model, spec.batch)
        run: EdgeRun | None = None
        try:
            run = self._start(model, slot, spec, body)
            run.edge_queue_wait_s = loop.time() - started
            await run.send()
        except BaseException as exc:
            # The one way back: the run ends here (its slot released exactly once), or,
            # with no run made yet, the slot itself goes back.
            if run is None:
                self._release(slot)
            else:
                reason = f"not dispatched: {type(exc).__name__}"
                await run.abandon(reason, sent=not isinstance(exc, FrameTooLarge))
            refusal = _refusal(exc, slot.node_id)
            if refusal is None:
                raise
            raise refusal from exc
        return run

    async def _acquire(self, model: ModelEntry, batch: bool) -> ProviderSlot:
        queue = self.queues[model.id]
        index = self._indexes[model.id]
        # FIFO: nobody overtakes a waiter of its own class (and batch waits behind all).
        overtakes = len(queue) > 0 if batch else queue.interactive > 0
        slot = None if overtakes else index.select()
        if slot is not None:
            slot.take()
            self._metrics.publish_slot(slot)
            return slot
        if not index.any_usable:
            raise NoProviderAvailable(f"No provider of '{model.id}' is available right now")
        max_queue, timeout_s = self.fleet.queue_limits(model.id)
        # Each class has its own room: batch lines never take an interactive place.
        if (queue.batch if batch else queue.interactive) >= max_queue:
            raise QueueFull(f"The queue of '{model.id}' is full ({max_queue} waiting); retry later")
        waiter: asyncio.Future[ProviderSlot] = asyncio.get_running_loop().create_future()
        queue.push(waiter, batch=batch)
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
            if self.queues.get(model.id) is queue:  # else the model was removed meanwhile
                self._metrics.publish_queued(model.id, len(queue))
            self._check_idle()

    def _start(
        self, model: ModelEntry, slot: ProviderSlot, spec: RunSpec, body: RunBody
    ) -> EdgeRun:
        served = model.providers[slot.provider_id]
        entry = self.fleet.providers[slot.provider_id]
        link = self.links.get(slot.node_id)
        if link is None:  # the node left while this request waited for the slot
            raise NoProviderAvailable(f"node {slot.node_id} is gone", code="provider_unavailable")
        run_id = secrets.token_hex(16)  # 32 hex digits, like uuid4().hex, for less work
        timeout_ms = entry.request_timeout_ms or 600_000
        request = pb.RunRequest(
            run_id=run_id,
            model=model.id,
            provider_id=slot.provider_id,
            adapter=entry.type,
            target=served,
            operation=_OPERATIONS[spec.operation],
            body_json=body.with_model(served),  # target rewrite here and only here (S03)
            stream=spec.stream,
            deadline_unix_ms=int(time.time() * 1000) + timeout_ms,
            include_usage=spec.include_usage,
        )
        run = EdgeRun(
            run_id,
            request,
            slot.provider_id,
            link,
            served,
            asyncio.get_running_loop().time() + timeout_ms / 1000,
            self._run_finished,
            self._deadline_grace_s,
        )
        self.runs[run_id] = run
        return run

    def _run_finished(self, run: EdgeRun) -> None:
        self.runs.pop(run.run_id, None)
        slot = self.slots.get(run.provider_id)
        if slot is not None:
            self._release(slot)
        self._check_idle()

    def _release(self, slot: ProviderSlot) -> None:
        slot.release()
        self._metrics.publish_slot(slot)
        self._serve_queues(slot.model_ids())

    def _serve_queues(self, model_ids: Iterable[str]) -> None:
        """Hand free slots to the heads of these models' queues, FIFO, interactive first."""
        for model_id in model_ids:
            queue = self.queues.get(model_id)
            index = self._indexes.get(model_id)
            if not queue or index is None:
                continue
            while queue:
                slot = index.select()
                if slot is None:
                    break
                waiter = queue.pop_waiting()
                if waiter is None:
                    break
                slot.take()
                self._metrics.publish_slot(slot)
                waiter.set_result(slot)
            self._metrics.publish_queued(model_id, len(queue))

    def _fail_waiters(self, queue: ModelQueue[ProviderSlot], reason: str) -> None:
        while (waiter := queue.pop_waiting()) is not None:
            waiter.set_exception(NoProviderAvailable(reason))

    def _slots_of_node(self, node_id: str) -> list[ProviderSlot]:
        return [slot for slot in self.slots.values() if slot.node_id == node_id]

    def stop_admitting(self, reason: str) -> None:
        """The edge is draining: runs and waiters already here go on, new ones are refused."""
        self._stopping = reason

    @property
    def idle(self) -> bool:
        """No run in flight, no slot taken (a waiter handed one is about to start its run)
        and nobody waiting for a slot: the drain is over."""
        return (
            not self.runs
            and not any(self.queues.values())
            and not any(slot.own_in_flight for slot in self.slots.values())
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
        waiter (a 503)."""
        self.stop_admitting(reason)
        for queue in self.queues.values():  # first: a slot a run frees must go to nobody
            while (waiter := queue.pop_waiting()) is not None:
                waiter.set_exception(ShuttingDown(reason))
        for run in list(self.runs.values()):
            await run.cancel(reason)

    def queued(self, model_id: str) -> int:
        queue = self.queues.get(model_id)
        return len(queue) if queue else 0


def _refusal(exc: BaseException, node_id: str) -> EdgeError | None:
    """The ``EdgeError`` a run that did not reach its node ends with, for what the edge
    understands; ``None``: raise the original (an ``EdgeError`` already, a cancellation,
    or a bug, which the request's boundary answers with a 500 and logs)."""
    if isinstance(exc, FrameTooLarge):
        return RequestTooLarge(
            f"The request is too large: its run takes {exc.length} bytes on its way to "
            f"the provider, over this server's limit of {exc.maximum} bytes."
        )
    if isinstance(exc, ConnectionError):
        message = f"node {node_id} unreachable: {exc}"
        return NoProviderAvailable(message, code="provider_unavailable")
    return None
