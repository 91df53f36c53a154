"""Failover before the first byte (docs/ARCHITECTURE.md#failover), on the real dispatcher
with fake node links: which failures are run again, where, how often, and what the
reader (the SSE relay, the JSON answer, a batch line) sees of it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.batches import DONE, LineRecord
from iop_edge.domain.events import (
    Completed,
    Delta,
    ErrorCode,
    Failed,
    Retrying,
    RunEvent,
    RunOrder,
)
from iop_edge.domain.faults import retryable
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.batch_lines import LineRunner
from iop_edge.service.catalog import PoolCatalog
from iop_edge.service.run_reader import Collector, follow
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_edge.testing import read_all
from iop_proto.v1 import runtime_pb2 as pb

MODEL = "m"
UNAVAILABLE = Failed(ErrorCode.PROVIDER_UNAVAILABLE, "connection refused")
# A 5xx leaves the provider available (an unreachable one leaves selection at once).
ERROR_503 = Failed(ErrorCode.PROVIDER_ERROR, "upstream 503", provider_status=503)


class FakeNode:
    """A node link that records what it was sent."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.sent: list[RunOrder] = []
        self.cancelled: list[str] = []
        self.got_run = asyncio.Event()

    async def send_run(self, request: RunOrder) -> None:
        self.sent.append(request)
        self.got_run.set()

    async def send_cancel(self, run_id: str, reason: str) -> None:
        self.cancelled.append(run_id)


def provider(pid: str, capacity: int = 1, **changes: object) -> ProviderEntry:
    entry = ProviderEntry(
        id=pid,
        node_id=f"node-{pid}",
        type="mock",
        category="local_inference",
        models=(f"served-{pid}",),
        capacity=capacity,
        max_queue=4,
        queue_timeout_ms=5_000,
        request_timeout_ms=30_000,
    )
    return replace(entry, **changes)  # type: ignore[arg-type]


def fleet(*entries: ProviderEntry, retries: int = 2) -> Fleet:
    served = {e.id: f"served-{e.id}" for e in entries}
    model = ModelEntry(MODEL, MODEL, served, retries=retries)
    return Fleet(version=1, models={MODEL: model}, providers={e.id: e for e in entries})


def spec(*, stream: bool = False, batch: bool = False) -> RunSpec:
    return RunSpec(
        model=MODEL,
        operation=Operation.CHAT_COMPLETIONS,
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        stream=stream,
        include_usage=False,
        batch=batch,
    )


class Pool:
    """A dispatcher over providers ``a``, ``b`` ... on nodes ``node-a``, ``node-b`` ...,
    all available, each with its fake node link."""

    def __init__(self, *entries: ProviderEntry, retries: int = 2) -> None:
        self.registry = CollectorRegistry()
        self.dispatcher = Dispatch(EdgeMetrics.create(self.registry))
        self.dispatcher.pool.apply_fleet(fleet(*entries, retries=retries))
        self.nodes: dict[str, FakeNode] = {}
        for entry in entries:
            node = self.nodes[entry.id] = FakeNode(entry.node_id)
            state = pb.ProviderState(provider_id=entry.id, health=pb.HEALTH_AVAILABLE)
            self.dispatcher.pool.node_connected(node, provider_reports([state]))

    def last_order(self, pid: str) -> RunOrder:
        return self.nodes[pid].sent[-1]

    def deliver(self, pid: str, *events: RunEvent) -> None:
        """Events from provider ``pid``'s node for the last run it was sent."""
        run_id = self.last_order(pid).run_id
        for event in events:
            run = self.dispatcher.runs.get(run_id)
            assert run is not None
            run.deliver(event)

    def retries(self, failed_provider: str) -> float:
        labels = {"model": MODEL, "provider": failed_provider}
        return self.registry.get_sample_value("iop_edge_retries_total", labels) or 0.0

    def in_flight(self) -> list[int]:
        return [slot.in_flight for slot in self.dispatcher.pool.slots()]


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("failed", "expected"),
    [
        (Failed(ErrorCode.PROVIDER_UNAVAILABLE, "refused"), True),
        (Failed(ErrorCode.PROVIDER_UNAVAILABLE, "node node-a lost"), True),
        (Failed(ErrorCode.PROVIDER_TIMEOUT, "stalled"), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "bad gateway", provider_status=502), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "internal", provider_status=500), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "reset mid-response", provider_status=0), True),
        (Failed(ErrorCode.PROVIDER_ERROR, "bad request", provider_status=400), False),
        (Failed(ErrorCode.PROVIDER_ERROR, "rate limited", provider_status=429), False),
        (Failed(ErrorCode.INVALID_REQUEST, "no messages"), False),
        # the provider does not offer the operation: another of the model may
        (Failed(ErrorCode.INVALID_REQUEST, "no embeddings", provider_status=501), True),
        (Failed(ErrorCode.NOT_FOUND, "no such model"), False),
        # the model's other providers serve the same context: the client must shorten it
        (Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", 400, 0, 256, 431), False),
        (Failed(ErrorCode.CANCELLED, "client gone"), False),
        (Failed(ErrorCode.DEADLINE_EXCEEDED, "too late"), False),
        (Failed(ErrorCode.QUEUE_FULL, "node queue full"), False),
        (Failed(ErrorCode.QUEUE_TIMEOUT, "node queue timeout"), False),
        (Failed(ErrorCode.INTERNAL, "bug"), False),
    ],
)
def test_retryable_is_the_provider_s_fault_not_the_request_s(
    failed: Failed, expected: bool
) -> None:
    assert retryable(failed) is expected


# ------------------------------------------------------------------ where and how often


@pytest.mark.parametrize("stream", [True, False])
async def test_a_run_failing_before_its_first_byte_goes_to_the_other_provider(
    stream: bool,
) -> None:
    pool = Pool(provider("a"), provider("b"))
    run = await pool.dispatcher.open_run(spec(stream=stream))
    client_id = run.run_id
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", UNAVAILABLE)
    await pool.nodes["b"].got_run.wait()
    pool.deliver("b", Delta(text="hi", role="assistant"), Completed(finish_reason="stop"))
    events = await reader

    assert [type(e) for e in events] == [Retrying, Delta, Completed]
    assert events[0] == Retrying(UNAVAILABLE, "a")
    first, second = pool.nodes["a"].sent[0], pool.nodes["b"].sent[0]
    assert second.target == "served-b"
    assert second.run_id != first.run_id  # a node that failed a run never sees its id again
    assert run.run_id == client_id == first.run_id  # the client keeps one id
    assert (run.provider_id, run.node_id, run.target) == ("b", "node-b", "served-b")
    assert second.body_json == first.body_json.replace(b"served-a", b"served-b")
    assert pool.retries("a") == 1
    assert pool.in_flight() == [0, 0]
    attempts = run.attempt_records()
    assert [(a.run_id, a.provider_id, a.node_id) for a in attempts] == [
        (first.run_id, "a", "node-a"),
        (second.run_id, "b", "node-b"),
    ]
    assert [(a.outcome, a.error_code) for a in attempts] == [
        ("failed", "provider_unavailable"),
        ("completed", ""),
    ]
    assert all(a.started_ms > 0 and a.duration_ms >= 1 for a in attempts)


async def test_a_non_streamed_answer_drops_what_the_failed_attempt_produced() -> None:
    pool = Pool(provider("a"), provider("b"))
    run = await pool.dispatcher.open_run(spec(stream=False))
    collector = Collector()
    reader = asyncio.create_task(follow(run, collector))
    pool.deliver("a", Delta(text="from a "), Delta(text="more"))
    await settle()
    assert [d.text for d in collector.deltas] == ["from a ", "more"]  # kept, not yet written
    pool.deliver("a", Failed(ErrorCode.PROVIDER_ERROR, "upstream 503", provider_status=503))
    await pool.nodes["b"].got_run.wait()
    pool.deliver("b", Delta(text="from b"), Completed(finish_reason="stop"))

    assert isinstance(await reader, Completed)
    assert [d.text for d in collector.deltas] == ["from b"]


async def test_a_stream_past_its_first_delta_ends_with_the_error_on_the_same_provider() -> None:
    pool = Pool(provider("a"), provider("b"))
    run = await pool.dispatcher.open_run(spec(stream=True))
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", Delta(text="hi"), UNAVAILABLE)
    events = await reader

    assert events == [Delta(text="hi"), UNAVAILABLE]
    assert pool.nodes["b"].sent == []
    assert pool.retries("a") == 0
    assert len(run.attempt_records()) == 1


@pytest.mark.parametrize(
    "failed",
    [
        Failed(ErrorCode.PROVIDER_ERROR, "bad request", provider_status=400),
        Failed(ErrorCode.INVALID_REQUEST, "no"),
        Failed(ErrorCode.CANCELLED, "gone"),
    ],
)
async def test_a_failure_that_is_not_the_provider_s_fault_is_the_client_s(failed: Failed) -> None:
    pool = Pool(provider("a"), provider("b"))
    run = await pool.dispatcher.open_run(spec())
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", failed)
    assert await reader == [failed]
    assert pool.nodes["b"].sent == []


async def test_retries_are_bounded_per_model_and_never_go_back_to_a_provider() -> None:
    pool = Pool(provider("a"), provider("b"), provider("c"), provider("d"), retries=2)
    run = await pool.dispatcher.open_run(spec())
    reader = asyncio.create_task(read_all(run))
    for pid in ("a", "b", "c"):
        await pool.nodes[pid].got_run.wait()
        pool.deliver(pid, Failed(ErrorCode.PROVIDER_ERROR, f"{pid} 500", provider_status=500))
    events = await reader

    assert [type(e) for e in events] == [Retrying, Retrying, Failed]
    assert events[-1] == Failed(ErrorCode.PROVIDER_ERROR, "c 500", provider_status=500)
    assert pool.nodes["d"].sent == []  # two retries: three attempts in all
    assert [len(node.sent) for node in pool.nodes.values()] == [1, 1, 1, 0]
    assert [pool.retries(p) for p in "abc"] == [1, 1, 0]
    assert pool.in_flight() == [0, 0, 0, 0]


async def test_retries_zero_turns_failover_off() -> None:
    pool = Pool(provider("a"), provider("b"), retries=0)
    run = await pool.dispatcher.open_run(spec())
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", UNAVAILABLE)
    assert await reader == [UNAVAILABLE]
    assert pool.nodes["b"].sent == []


async def test_with_nobody_else_the_client_gets_the_last_attempt_s_error() -> None:
    pool = Pool(provider("a", capacity=2))
    run = await pool.dispatcher.open_run(spec())
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", UNAVAILABLE)
    assert await reader == [UNAVAILABLE]
    assert len(pool.nodes["a"].sent) == 1  # never back to the provider that failed
    assert pool.retries("a") == 0  # nothing was tried again
    assert pool.in_flight() == [0]


async def test_the_node_lost_fails_its_runs_over() -> None:
    pool = Pool(provider("a", capacity=2), provider("b", capacity=2))
    runs = [await pool.dispatcher.open_run(spec()) for _ in range(2)]
    assert [r.provider_id for r in runs] == ["a", "b"]
    readers = [asyncio.create_task(read_all(r)) for r in runs]
    pool.dispatcher.pool.node_disconnected(pool.nodes["a"], "connection lost")
    await settle()
    assert len(pool.nodes["b"].sent) == 2
    for order in pool.nodes["b"].sent:
        run = pool.dispatcher.runs.get(order.run_id)
        assert run is not None
        run.deliver(Completed(finish_reason="stop"))
    ends = [(await reader)[-1] for reader in readers]
    assert ends == [Completed(finish_reason="stop")] * 2
    assert pool.retries("a") == 1


async def test_a_send_that_fails_on_a_broken_link_is_failed_over() -> None:
    class Broken(FakeNode):
        async def send_run(self, request: RunOrder) -> None:
            raise ConnectionResetError("reset by peer")

    pool = Pool(provider("a"), provider("b"))
    broken = Broken("node-a")
    state = pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)
    pool.dispatcher.pool.node_connected(broken, provider_reports([state]))
    run = await pool.dispatcher.open_run(spec())
    reader = asyncio.create_task(read_all(run))
    await pool.nodes["b"].got_run.wait()
    pool.deliver("b", Completed(finish_reason="stop"))
    events = await reader
    assert [type(e) for e in events] == [Retrying, Completed]
    assert events[0].failed.code is ErrorCode.PROVIDER_UNAVAILABLE  # type: ignore[union-attr]


# ------------------------------------------------------------------ the queue


async def test_a_retry_waits_its_turn_in_the_queue_when_the_others_are_busy() -> None:
    pool = Pool(provider("a"), provider("b"))
    on_a = await pool.dispatcher.open_run(spec())
    on_b = await pool.dispatcher.open_run(spec())
    waiting = asyncio.create_task(pool.dispatcher.open_run(spec()))  # first in the queue
    await settle()
    reader = asyncio.create_task(read_all(on_a))
    pool.deliver("a", ERROR_503)  # a's slot frees and goes to the waiter, FIFO
    await settle()
    assert waiting.done()
    assert waiting.result().provider_id == "a"
    assert pool.dispatcher.queued(MODEL) == 1  # the retry, for b only
    pool.deliver("b", Completed(finish_reason="stop"))  # on_b ends: its slot is the retry's
    await settle()
    assert on_a.provider_id == "b"
    pool.deliver("b", Completed(finish_reason="stop"))
    assert [type(e) for e in await reader] == [Retrying, Completed]
    assert [type(e) for e in await read_all(on_b)] == [Completed]


async def test_a_retry_that_may_not_take_a_free_slot_lets_the_next_waiter_take_it() -> None:
    pool = Pool(provider("a", capacity=2), provider("b"))
    first = await pool.dispatcher.open_run(spec())  # a
    on_b = await pool.dispatcher.open_run(spec())  # b
    second = await pool.dispatcher.open_run(spec())  # a
    assert [first.provider_id, on_b.provider_id, second.provider_id] == ["a", "b", "a"]
    reader = asyncio.create_task(read_all(first))
    pool.dispatcher.runs[pool.nodes["a"].sent[0].run_id].deliver(ERROR_503)
    await settle()
    assert pool.dispatcher.queued(MODEL) == 1  # the retry, waiting for b
    newcomer = await asyncio.wait_for(pool.dispatcher.open_run(spec()), 1)
    assert newcomer.provider_id == "a"  # the slot the retry may not take
    pool.deliver("b", Completed(finish_reason="stop"))
    await settle()
    assert first.provider_id == "b"
    pool.deliver("b", Completed(finish_reason="stop"))
    assert [type(e) for e in await reader] == [Retrying, Completed]


async def test_a_retry_waits_no_longer_than_the_request_s_deadline() -> None:
    # a's runs have 300 ms: the request's deadline is its first attempt's, whoever follows
    pool = Pool(provider("a", request_timeout_ms=300), provider("b"))
    run = await pool.dispatcher.open_run(spec())
    await pool.dispatcher.open_run(spec())  # b busy, for longer than that
    assert run.provider_id == "a"
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", UNAVAILABLE)
    await settle()
    assert pool.dispatcher.queued(MODEL) == 1  # the retry, waiting for b
    events = await asyncio.wait_for(reader, 2)  # b's queue would wait 5 s
    assert events == [UNAVAILABLE]  # the failure it had
    assert pool.dispatcher.queued(MODEL) == 0
    assert pool.in_flight() == [0, 1]


async def test_a_retry_runs_no_longer_than_the_request_s_deadline() -> None:
    pool = Pool(provider("a", request_timeout_ms=2_000), provider("b"))  # b: 30 s
    run = await pool.dispatcher.open_run(spec())
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", UNAVAILABLE)
    await pool.nodes["b"].got_run.wait()
    first, retry = pool.last_order("a"), pool.last_order("b")
    assert retry.deadline_unix_ms <= first.deadline_unix_ms  # not b's own 30 s from now
    pool.deliver("b", Completed(finish_reason="stop"))
    await reader


async def test_cancelling_a_run_while_its_retry_waits_ends_it_and_frees_the_place() -> None:
    pool = Pool(provider("a"), provider("b"))
    run = await pool.dispatcher.open_run(spec())
    await pool.dispatcher.open_run(spec())  # b busy
    reader = asyncio.create_task(read_all(run))
    pool.deliver("a", UNAVAILABLE)
    await settle()
    assert pool.dispatcher.queued(MODEL) == 1
    await run.cancel("client gone")
    events = await reader
    assert events == [Failed(ErrorCode.CANCELLED, "client gone")]
    assert pool.dispatcher.queued(MODEL) == 0
    assert pool.in_flight() == [0, 1]


# ------------------------------------------------------------------ batch lines


async def test_a_batch_line_fails_over_like_a_request() -> None:
    pool = Pool(provider("a"), provider("b"))
    d = pool.dispatcher
    lines = LineRunner(d, PoolCatalog(d.fleet, d.pool, d), clock=lambda: 1.0)
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    line = LineRecord("batch_1", 0, "c0", body, None)
    running = asyncio.create_task(lines.run("/v1/chat/completions", line, "r0"))
    await pool.nodes["a"].got_run.wait()
    pool.deliver("a", Delta(text="lost"), UNAVAILABLE)
    await pool.nodes["b"].got_run.wait()
    pool.deliver("b", Delta(text="kept"), Completed(finish_reason="stop"))
    outcome = await running
    assert outcome.result.state == DONE, outcome
    assert outcome.result.response is not None
    assert "kept" in outcome.result.response
    assert "lost" not in outcome.result.response
