"""A run's guards on its one timer: the node's acknowledgement, the stall, the deadline.

A run whose node does not acknowledge it in time fails ``provider_unavailable`` and
its node's providers leave selection until the node speaks again; a stream that goes
quiet fails ``provider_timeout``; a node that never said it acknowledges (an older
version) is judged only on its deadline. Timeouts are tiny here; what is checked is
the outcome, not the time it took.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports, run_event
from iop_edge.domain.events import (
    ACCEPTED,
    Completed,
    Delta,
    ErrorCode,
    Failed,
    RunEvent,
    RunOrder,
    Started,
)
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.request_run import ACK_SECONDS_PER_MIB, RequestRun
from iop_edge.service.runs import RunGuards
from iop_edge.testing import WiredDispatcher, read_all
from iop_proto.v1 import runtime_pb2 as pb

SHORT = 0.05  # seconds: a guard that passes within the test


class Node:
    def __init__(self, node_id: str, *, acknowledges_runs: bool = True) -> None:
        self.node_id = node_id
        self.acknowledges_runs = acknowledges_runs
        self.sent: list[RunOrder] = []
        self.cancelled: dict[str, str] = {}

    async def send_run(self, request: RunOrder) -> None:
        self.sent.append(request)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        self.cancelled[run_id] = reason


def provider(pid: str, node: str) -> ProviderEntry:
    return ProviderEntry(
        id=pid,
        node_id=node,
        type="mock",
        category="local_inference",
        models=(pid,),
        capacity=2,
        max_queue=2,
        queue_timeout_ms=200,
        request_timeout_ms=30_000,
    )


def wired(guards: RunGuards) -> WiredDispatcher:
    dispatcher = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()), guards=guards)
    providers = {"a": provider("a", "node-a"), "b": provider("b", "node-b")}
    # No retries: these tests read one attempt's end (test_failover.py reads past it).
    model = ModelEntry("m", "M", {"a": "m-a", "b": "m-b"}, retries=0)
    dispatcher.pool.apply_fleet(Fleet(version=1, models={"m": model}, providers=providers))
    return dispatcher


def connect(dispatcher: WiredDispatcher, node: Node, provider_id: str) -> None:
    state = pb.ProviderState(provider_id=provider_id, health=pb.HEALTH_AVAILABLE)
    dispatcher.pool.node_connected(node, provider_reports([state]))


def spec(stream: bool = False) -> RunSpec:
    return RunSpec("m", Operation.CHAT_COMPLETIONS, {"model": "m", "messages": []}, stream, False)


async def last_event(run: RequestRun) -> RunEvent:
    return (await read_all(run))[-1]


def health(dispatcher: WiredDispatcher, provider_id: str) -> str:
    slot = dispatcher.pool.slot(provider_id)
    assert slot is not None
    return slot.health


async def test_an_unacknowledged_run_fails_and_takes_its_node_out_of_selection() -> None:
    dispatcher = wired(RunGuards(ack_timeout_s=SHORT))
    node_a, node_b = Node("node-a"), Node("node-b")
    connect(dispatcher, node_a, "a")
    connect(dispatcher, node_b, "b")
    run = await dispatcher.open_run(spec())
    assert run.provider_id == "a"  # ties go to the first listed

    ended = await last_event(run)
    assert isinstance(ended, Failed)
    assert ended.code is ErrorCode.PROVIDER_UNAVAILABLE
    assert ended.message == f"node node-a did not acknowledge the run within {SHORT:g} s"
    assert run.run_id in node_a.cancelled  # a node that wakes up drops it
    assert health(dispatcher, "a") == UNAVAILABLE
    assert dispatcher.runs_in_flight() == 0

    following = await dispatcher.open_run(spec())
    assert following.provider_id == "b"  # the silent node gets nothing new
    following.deliver(ACCEPTED)
    following.deliver(Completed("stop"))

    # The node's next snapshot is its word again.
    state = pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)
    dispatcher.pool.apply_snapshot("node-a", provider_reports([state]))
    assert health(dispatcher, "a") == AVAILABLE


class SlowWriter(Node):
    """A link whose ``send_run`` returns only after ``seconds``: a large order that takes
    its edge that long to encode, encrypt and write."""

    def __init__(self, node_id: str, seconds: float) -> None:
        super().__init__(node_id)
        self.seconds = seconds

    async def send_run(self, request: RunOrder) -> None:
        await asyncio.sleep(self.seconds)
        await super().send_run(request)


async def test_the_acknowledgement_is_timed_from_when_the_order_has_left() -> None:
    dispatcher = wired(RunGuards(ack_timeout_s=SHORT * 2))
    node = SlowWriter("node-a", SHORT * 4)  # the order leaves two ack timeouts late
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec())  # returns once the order has left
    assert [order.run_id for order in node.sent] == [run.run_id]
    await asyncio.sleep(SHORT)  # within the ack timeout counted from the send
    assert not run.attempt_finished
    run.deliver(ACCEPTED)
    run.deliver(Completed("stop"))
    assert await read_all(run) == [Completed("stop")]
    assert health(dispatcher, "a") == AVAILABLE

    # a node that does not acknowledge a slowly written order still fails it
    silent = await dispatcher.open_run(spec())
    ended = await last_event(silent)
    assert isinstance(ended, Failed)
    assert ended.code is ErrorCode.PROVIDER_UNAVAILABLE
    assert health(dispatcher, "a") == UNAVAILABLE


async def test_a_large_order_gives_its_node_a_second_per_mib_to_acknowledge() -> None:
    # The node reads, decrypts and decodes the whole order before it can acknowledge it.
    dispatcher = wired(RunGuards(ack_timeout_s=SHORT))
    node = Node("node-a")
    connect(dispatcher, node, "a")
    quarter_mib = {"model": "m", "messages": [{"role": "user", "content": "x" * (1 << 18)}]}
    large = RunSpec("m", Operation.CHAT_COMPLETIONS, quarter_mib, False, False)
    run = await dispatcher.open_run(large)
    allowance = len(node.sent[-1].body_json) / (1 << 20) * ACK_SECONDS_PER_MIB
    assert allowance >= 0.25
    await asyncio.sleep(SHORT * 3)  # past the plain timeout, within the allowance
    assert not run.attempt_finished
    run.deliver(ACCEPTED)
    run.deliver(Completed("stop"))
    assert await read_all(run) == [Completed("stop")]

    # a node that never acknowledges it still fails it, once the allowance has passed too
    silent = await dispatcher.open_run(large)
    started = asyncio.get_running_loop().time()
    ended = await last_event(silent)
    assert asyncio.get_running_loop().time() - started >= SHORT + allowance
    assert isinstance(ended, Failed)
    bound = SHORT + allowance
    assert ended.message == f"node node-a did not acknowledge the run within {bound:.3g} s"
    assert health(dispatcher, "a") == UNAVAILABLE


async def test_an_acknowledged_run_is_left_to_its_deadline() -> None:
    dispatcher = wired(RunGuards(ack_timeout_s=SHORT))
    node = Node("node-a")
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec())
    accepted = run_event(pb.RunEvent(run_id=run.run_id, accepted={}))
    assert accepted is ACCEPTED
    assert dispatcher.runs.get(run.run_id) is run
    run.deliver(accepted)
    await asyncio.sleep(SHORT * 3)  # well past the ack timeout: nothing happens
    assert not run.attempt_finished
    run.deliver(Completed("stop"))
    assert await read_all(run) == [Completed("stop")]  # the acknowledgement was never queued
    assert health(dispatcher, "a") == AVAILABLE


async def test_a_node_that_does_not_acknowledge_runs_is_not_timed() -> None:
    dispatcher = wired(RunGuards(ack_timeout_s=SHORT))
    node = Node("node-a", acknowledges_runs=False)  # registered without the flag
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec())
    await asyncio.sleep(SHORT * 3)
    assert not run.attempt_finished
    run.deliver(Completed("stop"))
    assert await last_event(run) == Completed("stop")


async def test_a_stream_that_goes_quiet_after_its_first_token_fails_with_a_timeout() -> None:
    dispatcher = wired(RunGuards(ack_timeout_s=10, stall_timeout_s=SHORT * 2))
    node = Node("node-a")
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec(stream=True))
    run.deliver(ACCEPTED)
    run.deliver(Started("a"))
    run.deliver(Delta("hi"))
    ended = await last_event(run)
    assert isinstance(ended, Failed)
    assert ended.code is ErrorCode.PROVIDER_TIMEOUT
    assert ended.message == f"no output for {SHORT * 2:g} s"
    assert health(dispatcher, "a") == AVAILABLE  # a slow provider, not a lost node


async def test_the_first_token_has_its_own_bound_apart_from_the_stall() -> None:
    # A long prompt's prefill behind a busy slot: silent for longer than the stall bound,
    # within the first-token bound, then tokens; only from there does the stall bound hold.
    dispatcher = wired(RunGuards(stall_timeout_s=SHORT, first_token_timeout_s=SHORT * 8))
    node = Node("node-a")
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec(stream=True))
    run.deliver(ACCEPTED)
    run.deliver(Started("a"))
    await asyncio.sleep(SHORT * 3)
    assert not run.attempt_finished
    run.deliver(Delta("hi"))
    ended = await last_event(run)
    assert isinstance(ended, Failed)
    assert ended.message == f"no output for {SHORT:g} s"


async def test_a_stream_without_a_first_token_fails_at_the_first_token_bound() -> None:
    dispatcher = wired(RunGuards(stall_timeout_s=SHORT, first_token_timeout_s=SHORT * 3))
    node_a, node_b = Node("node-a"), Node("node-b")
    connect(dispatcher, node_a, "a")
    connect(dispatcher, node_b, "b")
    opened = await dispatcher.open_run(spec(stream=True))
    run = opened
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    run.deliver(ACCEPTED)
    ended = await last_event(run)
    assert isinstance(ended, Failed)
    assert ended.code is ErrorCode.PROVIDER_TIMEOUT  # retryable: another provider may be free
    assert ended.message == f"no first token within {SHORT * 3:g} s"
    assert loop.time() - sent_at >= SHORT * 3
    assert run.run_id in node_a.cancelled
    assert health(dispatcher, "a") == AVAILABLE


async def test_the_first_token_bound_off_leaves_the_wait_to_the_deadline() -> None:
    dispatcher = wired(RunGuards(stall_timeout_s=SHORT))
    node = Node("node-a")
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec(stream=True))
    run.deliver(ACCEPTED)
    await asyncio.sleep(SHORT * 3)
    assert not run.attempt_finished
    run.deliver(Completed("stop"))
    assert await last_event(run) == Completed("stop")


async def test_each_event_moves_the_stall_deadline() -> None:
    dispatcher = wired(RunGuards(stall_timeout_s=SHORT * 4))
    node = Node("node-a", acknowledges_runs=False)
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec(stream=True))
    for _ in range(8):  # twice the stall timeout in all, never that long between events
        await asyncio.sleep(SHORT)
        run.deliver(Delta("x"))
    run.deliver(Completed("stop"))
    assert await last_event(run) == Completed("stop")


async def test_a_non_streamed_run_is_never_failed_as_stalled() -> None:
    dispatcher = wired(RunGuards(stall_timeout_s=SHORT))
    node = Node("node-a")
    connect(dispatcher, node, "a")
    run = await dispatcher.open_run(spec(stream=False))
    run.deliver(ACCEPTED)
    await asyncio.sleep(SHORT * 3)  # its answer comes whole, at the end
    assert not run.attempt_finished
    run.deliver(Completed("stop"))
    assert await last_event(run) == Completed("stop")
