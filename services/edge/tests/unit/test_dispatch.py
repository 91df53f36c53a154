"""Dispatch with a fake node link: target rewrite, the per-model FIFO queue, node loss."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import failed as failed_event
from iop_edge.adapters.run_wire import provider_reports, run_event
from iop_edge.domain.events import Completed, ErrorCode, RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.errors import ModelNotFound, NoProviderAvailable, QueueFull, QueueTimeout
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.request_run import RequestRun
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_edge.testing import read_all
from iop_proto.v1 import runtime_pb2 as pb


class FakeNode:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.sent: list[RunOrder] = []
        self.cancelled: list[str] = []

    async def send_run(self, request: RunOrder) -> None:
        self.sent.append(request)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        self.cancelled.append(run_id)


def provider(pid: str, node: str, capacity: int, max_queue: int = 2) -> ProviderEntry:
    return ProviderEntry(
        id=pid,
        node_id=node,
        type="mock",
        category="local_inference",
        models=(pid,),
        capacity=capacity,
        max_queue=max_queue,
        queue_timeout_ms=200,
        request_timeout_ms=30_000,
    )


def fleet(capacity_a: int = 1, capacity_b: int = 1, max_queue: int = 2) -> Fleet:
    providers = {
        "a": provider("a", "node-a", capacity_a, max_queue),
        "b": provider("b", "node-b", capacity_b, 0),
    }
    model = ModelEntry("qwen:35b", "Qwen", {"a": "Qwen/Served-A", "b": "qwen-b"})
    return Fleet(version=1, models={model.id: model}, providers=providers)


def spec(batch: bool = False) -> RunSpec:
    return RunSpec(
        model="qwen:35b",
        operation=Operation.CHAT_COMPLETIONS,
        body={"model": "qwen:35b", "messages": [], "seed": 7},
        stream=True,
        include_usage=False,
        batch=batch,
    )


def available(dispatcher: Dispatch, node: FakeNode, *providers: str) -> None:
    states = [pb.ProviderState(provider_id=p, health=pb.HEALTH_AVAILABLE) for p in providers]
    dispatcher.pool.node_connected(node, provider_reports(states))


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


@pytest.fixture
def dispatcher() -> Dispatch:
    d = Dispatch(EdgeMetrics.create(CollectorRegistry()))
    d.pool.apply_fleet(fleet())
    return d


async def test_target_is_rewritten_to_the_served_name_of_the_chosen_provider(
    dispatcher: Dispatch,
) -> None:
    node_a = FakeNode("node-a")
    available(dispatcher, node_a, "a")
    run = await dispatcher.open_run(spec())
    [request] = node_a.sent
    assert (request.model, request.provider_id, request.target) == (
        "qwen:35b",
        "a",
        "Qwen/Served-A",
    )
    body = json.loads(request.body_json)
    assert body == {"model": "Qwen/Served-A", "messages": [], "seed": 7}
    assert run.provider_id == "a"


async def test_the_less_loaded_provider_of_the_pool_is_chosen(dispatcher: Dispatch) -> None:
    dispatcher.pool.apply_fleet(fleet(capacity_a=3, capacity_b=3))
    node_a, node_b = FakeNode("node-a"), FakeNode("node-b")
    available(dispatcher, node_a, "a")
    available(dispatcher, node_b, "b")
    chosen = [(await dispatcher.open_run(spec())).provider_id for _ in range(4)]
    assert chosen == ["a", "b", "a", "b"]  # ties go to the first listed, then the ratio


async def test_unknown_model_and_no_available_provider(dispatcher: Dispatch) -> None:
    with pytest.raises(ModelNotFound):
        await dispatcher.open_run(RunSpec("nope", Operation.COMPLETIONS, {}, False, False))
    with pytest.raises(NoProviderAvailable):
        await dispatcher.open_run(spec())  # no node connected


async def test_queue_is_fifo_and_a_freed_slot_takes_the_head(dispatcher: Dispatch) -> None:
    node_a = FakeNode("node-a")
    available(dispatcher, node_a, "a")
    first = await dispatcher.open_run(spec())
    waiting = [asyncio.create_task(dispatcher.open_run(spec())) for _ in range(2)]
    await asyncio.sleep(0)
    assert dispatcher.queued("qwen:35b") == 2
    complete(first)
    second = await asyncio.wait_for(waiting[0], 1)
    assert not waiting[1].done()
    complete(second)
    third = await asyncio.wait_for(waiting[1], 1)
    assert [r.run_id for r in (first, second, third)] == [r.run_id for r in node_a.sent]
    complete(third)
    assert dispatcher.pool.slot("a").in_flight == 0


async def test_full_queue_is_refused_and_waiting_times_out(dispatcher: Dispatch) -> None:
    available(dispatcher, FakeNode("node-a"), "a")
    await dispatcher.open_run(spec())
    waiting = [asyncio.create_task(dispatcher.open_run(spec())) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="is full"):
        await dispatcher.open_run(spec())
    for task in waiting:
        with pytest.raises(QueueTimeout):
            await task
    assert dispatcher.queued("qwen:35b") == 0


async def test_a_client_leaving_the_queue_leaves_at_once(dispatcher: Dispatch) -> None:
    node_a = FakeNode("node-a")
    available(dispatcher, node_a, "a")
    first = await dispatcher.open_run(spec())
    leaving = asyncio.create_task(dispatcher.open_run(spec()))
    staying = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    assert dispatcher.queued("qwen:35b") == 1
    complete(first)
    await asyncio.wait_for(staying, 1)
    assert len(node_a.sent) == 2


async def test_interactive_requests_go_before_batch_lines(dispatcher: Dispatch) -> None:
    available(dispatcher, FakeNode("node-a"), "a")
    first = await dispatcher.open_run(spec())
    batch = asyncio.create_task(dispatcher.open_run(spec(batch=True)))
    await asyncio.sleep(0)
    interactive = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)
    complete(first)
    await asyncio.wait_for(interactive, 1)
    assert not batch.done()
    complete(interactive.result())
    await asyncio.wait_for(batch, 1)


async def test_cancel_frees_the_slot_and_tells_the_node(dispatcher: Dispatch) -> None:
    node_a = FakeNode("node-a")
    available(dispatcher, node_a, "a")
    run = await dispatcher.open_run(spec())
    await run.cancel("client disconnected")
    assert node_a.cancelled == [run.run_id]
    assert dispatcher.pool.slot("a").in_flight == 0
    events = await read_all(run)
    assert events[-1].code == ErrorCode.CANCELLED


async def test_a_lost_node_ends_its_runs_and_its_providers_are_unavailable(
    dispatcher: Dispatch,
) -> None:
    node_a = FakeNode("node-a")
    available(dispatcher, node_a, "a")
    run = await dispatcher.open_run(spec())
    dispatcher.pool.node_disconnected(node_a, "heartbeat timeout")
    events = await read_all(run)
    assert events[-1].code == ErrorCode.PROVIDER_UNAVAILABLE
    assert "heartbeat timeout" in events[-1].message
    assert not dispatcher.pool.slot("a").usable
    assert dispatcher.pool.slot("a").in_flight == 0
    with pytest.raises(NoProviderAvailable):
        await dispatcher.open_run(spec())


async def test_a_snapshot_making_a_provider_available_serves_the_queue(
    dispatcher: Dispatch,
) -> None:
    dispatcher.pool.apply_fleet(fleet(capacity_a=1, capacity_b=1))
    node_a, node_b = FakeNode("node-a"), FakeNode("node-b")
    available(dispatcher, node_a, "a")
    await dispatcher.open_run(spec())
    dispatcher.pool.node_connected(
        node_b, provider_reports([pb.ProviderState(provider_id="b", health=pb.HEALTH_UNKNOWN)])
    )
    waiting = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)
    assert not waiting.done()
    dispatcher.pool.apply_snapshot(
        "node-b", provider_reports([pb.ProviderState(provider_id="b", health=pb.HEALTH_AVAILABLE)])
    )
    run = await asyncio.wait_for(waiting, 1)
    assert run.provider_id == "b"
    assert node_b.sent[0].target == "qwen-b"


async def test_batch_waiters_never_take_an_interactive_queue_place(
    dispatcher: Dispatch,
) -> None:
    available(dispatcher, FakeNode("node-a"), "a")
    await dispatcher.open_run(spec())
    batch = [asyncio.create_task(dispatcher.open_run(spec(batch=True))) for _ in range(2)]
    await asyncio.sleep(0)
    interactive = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)
    assert not interactive.done()  # queued, not refused, though two batch lines wait
    assert dispatcher.queued("qwen:35b") == 3
    for task in [*batch, interactive]:
        task.cancel()
    await asyncio.gather(*batch, interactive, return_exceptions=True)


async def test_a_provider_the_node_found_unreachable_is_skipped_at_once(
    dispatcher: Dispatch,
) -> None:
    dispatcher.pool.apply_fleet(fleet(capacity_a=2, capacity_b=2))
    node_a, node_b = FakeNode("node-a"), FakeNode("node-b")
    available(dispatcher, node_a, "a")
    available(dispatcher, node_b, "b")
    run = await dispatcher.open_run(spec())
    assert run.provider_id == "a"
    failed = pb.RunError(code=pb.ERROR_CODE_PROVIDER_UNAVAILABLE, message="connection refused")
    dispatcher.runs[run.run_id].deliver(failed_event(failed))
    # no snapshot yet, but the next request already goes to the other provider
    assert [(await dispatcher.open_run(spec())).provider_id for _ in range(2)] == ["b", "b"]


async def test_a_runs_end_carries_its_providers_load_and_cache_without_a_snapshot(
    dispatcher: Dispatch,
) -> None:
    """The node's ``ProviderLoad`` on a run's end reaches the run's provider after the
    edge let go of the run's slot: the node's count is kept (a run of another edge still
    there), the cache report replaces the last one, and a failed run's load counts too."""
    dispatcher.pool.apply_fleet(fleet(capacity_a=3))
    node_a = FakeNode("node-a")
    available(dispatcher, node_a, "a")
    slot = dispatcher.pool.slot("a")
    assert slot is not None
    run = await dispatcher.open_run(spec())
    assert (slot.own_in_flight, slot.reported_in_flight) == (1, 0)

    cache = pb.CacheState(prefixes=[pb.CachedPrefix(tail=7, blocks=3)], prompt_tokens=40)
    load = pb.ProviderLoad(in_flight=1, queued=2, cache=cache)
    end = run_event(
        pb.RunEvent(run_id=run.run_id, complete={"finish_reason": "stop", "load": load})
    )
    assert isinstance(end, Completed)
    assert end == Completed(finish_reason="stop")  # the load is the provider's, not the run's
    run.deliver(end)
    assert (slot.own_in_flight, slot.reported_in_flight, slot.node_queued) == (0, 1, 2)
    assert slot.cache.held == {7: 3}
    assert slot.cache.prompt_tokens == 40

    run = await dispatcher.open_run(spec())
    error = pb.RunError(code=pb.ERROR_CODE_PROVIDER_ERROR, load=pb.ProviderLoad(in_flight=0))
    run.deliver(failed_event(error))
    assert (slot.own_in_flight, slot.reported_in_flight, slot.node_queued) == (0, 0, 0)
    assert slot.cache.held == {7: 3}  # a load without a cache account leaves the report


async def test_a_runs_end_without_a_load_leaves_the_nodes_last_word(
    dispatcher: Dispatch,
) -> None:
    """An older node sends no load: its last snapshot stands, lowered by the release."""
    node_a = FakeNode("node-a")
    states = [pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE, queued=1)]
    dispatcher.pool.node_connected(node_a, provider_reports(states))
    slot = dispatcher.pool.slot("a")
    assert slot is not None
    run = await dispatcher.open_run(spec())
    run.deliver(Completed(finish_reason="stop"))
    assert (slot.own_in_flight, slot.reported_in_flight, slot.node_queued) == (0, 0, 1)
