"""Dispatch with a fake node link: keys take turns in a model's queue, priorities go
first, and batch lines backfill (their share of the slots, preemption) —
domain/queue.py, service/backfill.py."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, Failed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.queue import NO_SHARE, Share
from iop_edge.errors import Preempted
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.backfill import Backfill
from iop_edge.service.request_run import RequestRun
from iop_edge.testing import RecordingNodeLink
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_proto.v1 import runtime_pb2 as pb

MODEL = "m"


def fleet(capacity: int) -> Fleet:
    provider = ProviderEntry(
        id="a",
        node_id="node-a",
        type="mock",
        category="local_inference",
        models=("a",),
        capacity=capacity,
        max_queue=500,
        queue_timeout_ms=30_000,
        request_timeout_ms=30_000,
    )
    model = ModelEntry(MODEL, "M", {"a": "served"})
    return Fleet(version=1, models={MODEL: model}, providers={"a": provider})


def spec(share: Share = NO_SHARE, *, batch: bool = False) -> RunSpec:
    return RunSpec(
        model=MODEL,
        operation=Operation.CHAT_COMPLETIONS,
        body={"model": MODEL, "messages": []},
        stream=False,
        include_usage=False,
        batch=batch,
        share=share,
    )


def wired(
    capacity: int, backfill: Backfill | None = None, registry: CollectorRegistry | None = None
) -> tuple[Dispatch, RecordingNodeLink]:
    metrics = EdgeMetrics.create(registry or CollectorRegistry())
    dispatcher = Dispatch(metrics, backfill=backfill)
    dispatcher.pool.apply_fleet(fleet(capacity))
    node = RecordingNodeLink("node-a")
    states = [pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)]
    dispatcher.pool.node_connected(node, provider_reports(states))
    return dispatcher, node


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


async def serve_in_turn(
    dispatcher: Dispatch, first: RequestRun, tasks: dict[asyncio.Task[RequestRun], str]
) -> list[str]:
    """Complete the running run, note who got the slot next, until all were served."""
    order: list[str] = []
    seen: set[asyncio.Task[RequestRun]] = set()
    running = first
    while len(order) < len(tasks):
        complete(running)
        await settle()
        [started] = [t for t in tasks if t.done() and t not in seen]  # one slot: one start
        seen.add(started)
        order.append(tasks[started])
        running = started.result()
    complete(running)
    return order


async def test_a_key_behind_another_keys_burst_waits_one_turn() -> None:
    dispatcher, _ = wired(capacity=1)
    first = await dispatcher.open_run(spec(Share("a")))
    tasks = {asyncio.create_task(dispatcher.open_run(spec(Share("a")))): f"a{n}" for n in range(20)}
    await settle()
    tasks[asyncio.create_task(dispatcher.open_run(spec(Share("b"))))] = "b"
    await settle()
    order = await serve_in_turn(dispatcher, first, tasks)
    assert order.index("b") == 1  # one turn of a (the head of its burst), not twenty
    assert [n for n in order if n != "b"] == [f"a{n}" for n in range(20)]


async def test_a_higher_priority_goes_first_and_batch_last() -> None:
    dispatcher, _ = wired(capacity=1)
    first = await dispatcher.open_run(spec())
    tasks: dict[asyncio.Task[RequestRun], str] = {}
    for name, share, batch in (
        ("batch", Share("a", priority=9), True),
        ("low", Share("a", priority=-1), False),
        ("plain", Share("b"), False),
        ("high", Share("c", priority=3), False),
    ):
        tasks[asyncio.create_task(dispatcher.open_run(spec(share, batch=batch)))] = name
        await settle()
    assert await serve_in_turn(dispatcher, first, tasks) == ["high", "plain", "low", "batch"]


async def test_batch_lines_hold_at_most_their_share_and_interactive_starts_at_once() -> None:
    dispatcher, node = wired(capacity=4, backfill=Backfill(0.5, preempt=False))
    batch = [asyncio.create_task(dispatcher.open_run(spec(batch=True))) for _ in range(4)]
    await settle()
    assert sum(t.done() for t in batch) == 2  # half of 4 slots, though 2 more are free
    assert dispatcher.queued(MODEL) == 2
    interactive = [await dispatcher.open_run(spec()) for _ in range(2)]  # no wait
    assert len(node.sent) == 4
    for run in interactive:
        complete(run)
    await settle()
    assert sum(t.done() for t in batch) == 2  # freed interactive slots stay within the share
    for task in [t for t in batch if t.done()]:
        complete(task.result())
    await settle()
    assert all(t.done() for t in batch)  # the pool idle: the rest of the batch runs
    for task in batch:
        complete(task.result())


async def test_an_interactive_request_preempts_the_newest_batch_line() -> None:
    registry = CollectorRegistry()
    dispatcher, _ = wired(capacity=2, backfill=Backfill(1.0, preempt=True), registry=registry)
    older = await dispatcher.open_run(spec(batch=True))
    newer = await dispatcher.open_run(spec(batch=True))
    interactive = await asyncio.wait_for(dispatcher.open_run(spec()), 1)
    assert not interactive.ended
    assert newer.ended
    assert not older.ended
    end = newer.outcome
    assert isinstance(end, Failed)
    assert isinstance(newer.error(end), Preempted)
    assert dispatcher.pool.slot("a").in_flight == 2  # the batch line's slot, handed on
    preempted = registry.get_sample_value("iop_edge_batch_preemptions_total", {"model": MODEL})
    assert preempted == 1
    complete(older)
    complete(interactive)
    assert dispatcher.pool.slot("a").in_flight == 0


async def test_without_preemption_the_interactive_request_waits_for_a_batch_line() -> None:
    dispatcher, _ = wired(capacity=1, backfill=Backfill(1.0, preempt=False))
    line = await dispatcher.open_run(spec(batch=True))
    waiting = asyncio.create_task(dispatcher.open_run(spec()))
    await settle()
    assert not waiting.done()
    assert not line.ended
    complete(line)
    complete(await asyncio.wait_for(waiting, 1))


def test_the_share_is_of_the_usable_capacity_and_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="max_share"):
        Backfill(0)
    dispatcher, _ = wired(capacity=5)
    members = dispatcher.pool.indexes.get(MODEL).members  # type: ignore[union-attr]
    assert Backfill(0.5).cap(members) == 2
    assert Backfill(0.01).cap(members) == 1
    assert Backfill(1.0).cap(members) == 5
