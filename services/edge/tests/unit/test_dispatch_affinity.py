"""The dispatcher with cache affinity: sessions and prefixes steer selection, a request
waits a bounded time for the provider holding its cache, and every slot and waiter is
accounted for on every path (docs/ARCHITECTURE.md#cache-affinity)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.affinity import AffinityPolicy
from iop_edge.domain.events import Completed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.session_key import successor_key
from iop_edge.errors import NoProviderAvailable, QueueTimeout, ShuttingDown
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.request_run import RequestRun
from iop_edge.testing import RecordingNodeLink, WiredDispatcher
from iop_proto.prefix import BLOCK_CHARS
from iop_proto.v1 import runtime_pb2 as pb

SYSTEM = "You are a careful coding agent. " * (4 * BLOCK_CHARS // 32)


def fleet(
    capacity: int = 1, queue_timeout_ms: int = 2_000, pids: tuple[str, ...] = ("a", "b", "c")
) -> Fleet:
    providers = {
        pid: ProviderEntry(
            id=pid,
            node_id=f"n-{pid}",
            type="mock",
            category="local_inference",
            models=("m",),
            capacity=capacity,
            max_queue=8,
            queue_timeout_ms=queue_timeout_ms,
            request_timeout_ms=30_000,
        )
        for pid in pids
    }
    model = ModelEntry("m", "m", {pid: "served" for pid in providers})
    return Fleet(version=1, models={"m": model}, providers=providers)


def wired(
    policy: AffinityPolicy | None = None,
    capacity: int = 1,
    pids: tuple[str, ...] = ("a", "b", "c"),
    registry: CollectorRegistry | None = None,
) -> WiredDispatcher:
    metrics = EdgeMetrics.create(registry or CollectorRegistry())
    dispatcher = WiredDispatcher(metrics, affinity=policy)
    dispatcher.pool.apply_fleet(fleet(capacity, pids=pids))
    for pid in pids:
        connect(dispatcher, pid)
    return dispatcher


def connect(
    dispatcher: WiredDispatcher, pid: str, health: int = pb.HEALTH_AVAILABLE
) -> RecordingNodeLink:
    node = RecordingNodeLink(f"n-{pid}")
    state = pb.ProviderState(provider_id=pid, health=health)
    dispatcher.pool.node_connected(node, provider_reports([state]))
    return node


def turn(session: str | None, *history: str, chained: bool = False) -> RunSpec:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user", "content": text} for text in history]
    body = {"model": "m", "messages": messages}
    return RunSpec(
        "m", Operation.CHAT_COMPLETIONS, body, True, True, session=session, chained=chained
    )


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


async def waiting_aside() -> tuple[WiredDispatcher, RequestRun, asyncio.Task[RequestRun]]:
    """Two providers; a session's first turn on one, its second waiting for that one (the
    other is free, but the wait's bound is long): the dispatcher, the first run, the
    waiting request."""
    dispatcher = wired(
        AffinityPolicy(max_wait_s=30.0, default_prefill_ms_per_token=1000.0), pids=("a", "b")
    )
    first = await dispatcher.open_run(turn("s1", "one"))
    waiting = asyncio.create_task(dispatcher.open_run(turn("s1", "one", "two")))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert first.provider_id in dispatcher._pinned
    return dispatcher, first, waiting


async def test_a_session_returns_to_its_provider_with_a_free_slot_elsewhere() -> None:
    dispatcher = wired(capacity=2)
    first = await dispatcher.open_run(turn("s1", "one"))
    complete(first)
    await dispatcher.open_run(turn("other", "x" * 4 * BLOCK_CHARS))  # the seed's rule: a
    second = await dispatcher.open_run(turn("s1", "one", "two"))
    assert second.provider_id == first.provider_id


async def test_without_a_session_the_prefix_steers_the_next_turn() -> None:
    dispatcher = wired()
    first = await dispatcher.open_run(turn(None, "question " * 100))
    complete(first)
    # The seed's rule alone would pick the first provider of the fleet again for both.
    decoy = await dispatcher.open_run(turn(None, "unrelated " * 10))
    complete(decoy)
    second = await dispatcher.open_run(turn(None, "question " * 100, "follow-up"))
    assert second.provider_id == first.provider_id


async def test_a_busy_provider_holding_the_cache_is_waited_for_not_a_free_one() -> None:
    registry = CollectorRegistry()
    policy = AffinityPolicy(max_wait_s=5.0, default_prefill_ms_per_token=50.0)
    dispatcher = wired(policy, registry=registry)
    first = await dispatcher.open_run(turn("s1", "one"))
    home = first.provider_id
    await dispatcher.open_run(turn("s2", "two"))  # one busy besides: within the bound
    waiting = asyncio.create_task(dispatcher.open_run(turn("s1", "one", "two")))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the third is free, yet it waits for its cache
    complete(first)
    second = await asyncio.wait_for(waiting, 1)
    assert second.provider_id == home
    decisions = {"model": "m", "decision": "waited"}
    assert registry.get_sample_value("iop_edge_affinity_decisions_total", decisions) == 1


async def test_a_busy_provider_is_not_waited_for_past_its_bounded_share() -> None:
    dispatcher = wired(AffinityPolicy(max_wait_s=5.0, default_prefill_ms_per_token=50.0))
    first = await dispatcher.open_run(turn("s1", "one"))
    # Two providers idle: waiting for the third would leave the pool two thirds empty.
    second = await asyncio.wait_for(dispatcher.open_run(turn("s1", "one", "two")), 0.5)
    assert second.provider_id != first.provider_id


async def test_the_wait_is_bounded_then_the_seed_s_rule_decides_and_the_session_moves() -> None:
    dispatcher = wired(
        AffinityPolicy(max_wait_s=0.05, default_prefill_ms_per_token=50.0), pids=("a", "b")
    )
    first = await dispatcher.open_run(turn("s1", "one"))
    second = await asyncio.wait_for(dispatcher.open_run(turn("s1", "one", "two")), 1)
    assert second.provider_id != first.provider_id
    complete(first)
    complete(second)
    third = await dispatcher.open_run(turn("s1", "one", "two", "three"))
    assert third.provider_id == second.provider_id  # it moved once, and stays


async def test_with_no_free_slot_elsewhere_the_wait_goes_on_up_to_its_bound() -> None:
    # wait_s: 8 blocks * 64 tokens * 0.1 ms = 51 ms; max_wait_s 5 s.
    policy = AffinityPolicy(max_wait_s=5.0, default_prefill_ms_per_token=0.1)
    dispatcher = wired(policy, pids=("a", "b"))
    first = await dispatcher.open_run(turn("s1", "one"))
    await dispatcher.open_run(turn("s2", "two"))  # the other provider: busy too
    waiting = asyncio.create_task(dispatcher.open_run(turn("s1", "one", "two")))
    await asyncio.sleep(0.3)  # several times wait_s: renewed, still waiting for its cache
    assert not waiting.done()
    assert first.provider_id in dispatcher._pinned
    complete(first)
    second = await asyncio.wait_for(waiting, 1)
    assert second.provider_id == first.provider_id


async def test_a_waiter_whose_provider_goes_away_goes_elsewhere_at_once() -> None:
    dispatcher, first, waiting = await waiting_aside()
    node = dispatcher.pool.links.get(f"n-{first.provider_id}")
    assert node is not None
    dispatcher.pool.node_disconnected(node, "test")  # failover: its node is gone
    second = await asyncio.wait_for(waiting, 1)
    assert second.provider_id != first.provider_id


async def test_a_waiter_cancelled_while_waiting_leaves_nothing_behind() -> None:
    dispatcher, first, waiting = await waiting_aside()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    complete(first)
    assert dispatcher.idle
    assert all(slot.own_in_flight == 0 for slot in dispatcher.pool.slots())


async def test_a_stopping_edge_ends_a_waiter_with_its_refusal() -> None:
    dispatcher, _, waiting = await waiting_aside()
    await dispatcher.fail_all("edge stopping")
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(waiting, 1)
    assert not dispatcher._pinned


async def test_a_draining_edge_ends_a_waiter_at_once_and_lets_the_run_in_flight_finish() -> None:
    dispatcher, first, waiting = await waiting_aside()
    dispatcher.stop_admitting("edge stopping")
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(waiting, 1)  # not handed the slot the first turn frees
    assert not dispatcher._pinned
    assert not dispatcher.idle
    complete(first)
    assert dispatcher.idle
    assert dispatcher.runs_in_flight() == 0


async def test_a_waiter_whose_model_leaves_the_fleet_is_refused() -> None:
    dispatcher, _, waiting = await waiting_aside()
    gone = fleet(pids=("a", "b"))
    dispatcher.pool.apply_fleet(Fleet(version=2, models={}, providers=gone.providers))
    with pytest.raises(NoProviderAvailable):
        await asyncio.wait_for(waiting, 1)


async def test_a_full_pool_queues_as_before_and_keeps_fifo() -> None:
    dispatcher = wired(AffinityPolicy(max_wait_s=0.0))
    runs = [await dispatcher.open_run(turn(f"s{i}", str(i))) for i in range(3)]
    later = [asyncio.create_task(dispatcher.open_run(turn(f"s{i}", str(i), "+"))) for i in range(3)]
    await asyncio.sleep(0.01)
    for run in runs:
        complete(run)
        await asyncio.sleep(0)
    served = [await asyncio.wait_for(task, 1) for task in later]
    assert len({run.run_id for run in served}) == 3


async def test_a_queue_timeout_still_ends_a_request_that_waited_aside_first() -> None:
    dispatcher = WiredDispatcher(
        EdgeMetrics.create(CollectorRegistry()),
        affinity=AffinityPolicy(max_wait_s=0.05, default_prefill_ms_per_token=50.0),
    )
    dispatcher.pool.apply_fleet(fleet(queue_timeout_ms=50))
    for pid in ("a", "b"):
        connect(dispatcher, pid)
    await dispatcher.open_run(turn("s1", "one"))
    await dispatcher.open_run(turn("s2", "two"))
    with pytest.raises(QueueTimeout):
        await dispatcher.open_run(turn("s1", "one", "more"))
    assert not dispatcher._pinned


async def test_affinity_survives_the_node_s_restart() -> None:
    dispatcher = wired(capacity=2)
    first = await dispatcher.open_run(turn("s1", "one"))
    complete(first)
    node = dispatcher.pool.links.get(f"n-{first.provider_id}")
    assert node is not None
    dispatcher.pool.node_disconnected(node, "restart")
    connect(dispatcher, first.provider_id)
    second = await dispatcher.open_run(turn("s1", "one", "two"))
    assert second.provider_id == first.provider_id


async def test_a_responses_chain_follows_its_previous_response() -> None:
    dispatcher = wired(capacity=2)
    first = await dispatcher.open_run(turn(None, "hello", chained=True))
    complete(first)
    decoy = await dispatcher.open_run(turn(None, "elsewhere " * 30))
    complete(decoy)
    # The next turn carries only the id of the first response, and a short prompt.
    follow = RunSpec(
        "m",
        Operation.CHAT_COMPLETIONS,
        {"model": "m", "messages": [{"role": "user", "content": "and then?"}]},
        True,
        True,
        session=successor_key(first.run_id),
        chained=True,
    )
    second = await dispatcher.open_run(follow)
    assert second.provider_id == first.provider_id
