"""The dispatch path gives everything back: a failure at any step from the request's
checks to the node having the run leaves no slot taken, no queue place held and no run
behind, and the next request is served.

Each case injects one failure at one step (an error raised, a cancellation at an
await, a node gone) with small fakes of the node link; after each, the same
invariants are checked, whatever the exception was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports, run_request
from iop_edge.domain.events import Completed, Failed, RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.errors import (
    InvalidRequest,
    NoProviderAvailable,
    QueueTimeout,
    RequestTooLarge,
    from_failure,
)
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.limits import RUN_FRAME_OVERHEAD, SWITCHES_SLACK, RunBody
from iop_edge.service.request_run import RequestRun
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_edge.testing import read_all
from iop_proto import json_codec
from iop_proto.errors import ConnectionClosed
from iop_proto.framing import encode_frame
from iop_proto.v1 import runtime_pb2 as pb

MODEL = "m"
FRAME = 64 * 1024  # a small frame limit, so "too large" needs no megabytes


class Link:
    """A node link whose ``send_run`` fails as told (or waits, to be cancelled there)."""

    def __init__(
        self,
        fault: BaseException | None = None,
        *,
        hold: bool = False,
        hold_cancel: bool = False,
        frame_limit: int | None = None,
    ) -> None:
        self.node_id = "node-a"
        self.acknowledges_runs = False
        self.fault = fault
        self.hold = hold
        self.hold_cancel = hold_cancel
        self.frame_limit = frame_limit
        self.sending = asyncio.Event()  # send_run was entered
        self.gate = asyncio.Event()  # what holds, holds until this is set
        self.sent: list[RunOrder] = []
        self.cancelled: list[str] = []

    async def send_run(self, request: RunOrder) -> None:
        self.sending.set()
        message = run_request(request)  # as the real link converts it (and may fail to)
        if self.frame_limit is not None:  # the real link: encoding refuses an oversize frame
            envelope = pb.Envelope(message_id="edge-1", correlation_id=request.run_id)
            envelope.run_request.CopyFrom(message)
            encode_frame(envelope, self.frame_limit)
        if self.fault is not None:
            raise self.fault
        if self.hold:
            await self.gate.wait()  # as a drain() that does not return: cancelled there
        self.sent.append(request)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        self.cancelled.append(run_id)
        if self.hold_cancel:
            await self.gate.wait()


def provider(**changes: object) -> ProviderEntry:
    entry = ProviderEntry(
        id="a",
        node_id="node-a",
        type="mock",
        category="local_inference",
        models=("served-m",),
        capacity=1,
        max_queue=2,
        queue_timeout_ms=200,
        request_timeout_ms=30_000,
    )
    return replace(entry, **changes)  # type: ignore[arg-type]


def fleet(entry: ProviderEntry | None = None, cap: int = 100) -> Fleet:
    model = ModelEntry(MODEL, MODEL, {"a": "served-m"}, max_output_tokens=cap)
    entry = entry or provider()
    return Fleet(version=1, models={MODEL: model}, providers={entry.id: entry})


def spec(**body: object) -> RunSpec:
    return RunSpec(
        model=MODEL,
        operation=Operation.CHAT_COMPLETIONS,
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
        stream=False,
        include_usage=False,
    )


def connect(dispatcher: Dispatch, link: Link) -> None:
    dispatcher.pool.node_connected(
        link, provider_reports([pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)])
    )


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


def new_dispatcher(entry: ProviderEntry | None = None) -> Dispatch:
    dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()), max_frame_size=FRAME)
    dispatcher.pool.apply_fleet(fleet(entry))
    return dispatcher


async def settle() -> None:
    for _ in range(5):  # let shielded cancels and handed-over waiters run
        await asyncio.sleep(0)


@dataclass
class Case:
    """One failure at one step: ``inject`` drives the dispatcher into it and returns
    what ``open_run`` raised (``None`` when it did not)."""

    name: str
    inject: Callable[[Dispatch], Awaitable[BaseException | None]]
    expected: type[BaseException]
    told_node: bool = False  # the frame may have left: the node is asked to drop the run


async def _raised(awaitable: Awaitable[object]) -> BaseException | None:
    try:
        await awaitable
    except BaseException as exc:  # whatever it was: the test inspects it
        return exc
    return None


async def _with_link(dispatcher: Dispatch, link: Link, **body: object) -> BaseException | None:
    connect(dispatcher, link)
    return await _raised(dispatcher.open_run(spec(**body)))


async def _failed_in_send(dispatcher: Dispatch, fault: BaseException) -> BaseException | None:
    """A link that fails under the send makes an attempt that failed (nobody else to fail
    over to here): what the reader gets at its end, as the client would see it."""
    connect(dispatcher, Link(fault))
    run = await dispatcher.open_run(spec())
    events = await read_all(run)
    assert isinstance(events[-1], Failed), events
    return from_failure(events[-1])


async def _cancelled_in_send(dispatcher: Dispatch, *, twice: bool) -> BaseException | None:
    link = Link(hold=True, hold_cancel=twice)
    connect(dispatcher, link)
    task = asyncio.create_task(dispatcher.open_run(spec()))
    await link.sending.wait()
    task.cancel()
    if twice:
        await settle()
        task.cancel()  # again, while the node is being told
    return await _raised(task)


async def _busy(dispatcher: Dispatch) -> tuple[Link, RequestRun]:
    """node-a connected, its one slot taken by a run that is going."""
    link = Link()
    connect(dispatcher, link)
    return link, await dispatcher.open_run(spec())


async def _cancelled_in_queue(dispatcher: Dispatch) -> BaseException | None:
    _, first = await _busy(dispatcher)
    waiting = asyncio.create_task(dispatcher.open_run(spec()))
    await settle()
    assert dispatcher.queued(MODEL) == 1
    waiting.cancel()
    error = await _raised(waiting)
    complete(first)
    return error


async def _timed_out_in_queue(dispatcher: Dispatch) -> BaseException | None:
    _, first = await _busy(dispatcher)
    error = await _raised(dispatcher.open_run(spec()))
    complete(first)
    return error


async def _cancelled_when_handed_the_slot(dispatcher: Dispatch) -> BaseException | None:
    _, first = await _busy(dispatcher)
    waiting = asyncio.create_task(dispatcher.open_run(spec()))
    await settle()
    complete(first)  # the slot goes to the waiter, which has not resumed yet
    waiting.cancel()
    return await _raised(waiting)


async def _node_gone_when_handed_the_slot(dispatcher: Dispatch) -> BaseException | None:
    link, first = await _busy(dispatcher)
    waiting = asyncio.create_task(dispatcher.open_run(spec()))
    await settle()
    complete(first)  # handed over; before the waiter resumes, its node goes
    dispatcher.pool.node_disconnected(link, "connection lost")
    return await _raised(waiting)


async def _too_large_while_the_slot_is_busy(dispatcher: Dispatch) -> BaseException | None:
    _, first = await _busy(dispatcher)
    # Refused at once: it never waits for (or takes) a place in the full pool's queue.
    error = await _raised(dispatcher.open_run(spec(blob="x" * FRAME)))
    assert dispatcher.queued(MODEL) == 0
    complete(first)
    return error


async def _unbuildable_request(dispatcher: Dispatch) -> BaseException | None:
    dispatcher.pool.apply_fleet(fleet(provider(type=123)))  # no RunRequest can be built from it
    return await _with_link(dispatcher, Link())


CASES = [
    Case("body cannot be serialised", lambda d: _with_link(d, Link(), x=object()), TypeError),
    Case("output cap", lambda d: _with_link(d, Link(), max_tokens=2**31), InvalidRequest),
    Case("run frame too large", lambda d: _with_link(d, Link(), blob="x" * FRAME), RequestTooLarge),
    Case("too large, pool busy", _too_large_while_the_slot_is_busy, RequestTooLarge),
    Case("cancelled in the queue", _cancelled_in_queue, asyncio.CancelledError),
    Case("queue timeout", _timed_out_in_queue, QueueTimeout),
    Case("cancelled when handed a slot", _cancelled_when_handed_the_slot, asyncio.CancelledError),
    Case("node gone when handed a slot", _node_gone_when_handed_the_slot, NoProviderAvailable),
    Case("request cannot be built", _unbuildable_request, TypeError),
    Case(
        "encoding refuses the frame",
        # The body passes the dispatcher's check; the link's own limit is lower.
        lambda d: _with_link(d, Link(frame_limit=1024), blob="x" * 2048),
        RequestTooLarge,
    ),
    Case(
        "send: connection lost",
        lambda d: _failed_in_send(d, ConnectionClosed("peer went away")),
        NoProviderAvailable,
        told_node=True,
    ),
    Case(
        "send: connection reset",
        lambda d: _failed_in_send(d, ConnectionResetError()),
        NoProviderAvailable,
        told_node=True,
    ),
    Case(
        "send: a bug",
        lambda d: _with_link(d, Link(RuntimeError("boom"))),
        RuntimeError,
        told_node=True,
    ),
    Case(
        "send: interrupted",
        lambda d: _with_link(d, Link(KeyboardInterrupt())),
        KeyboardInterrupt,
        told_node=True,
    ),
    Case(
        "cancelled in send",
        lambda d: _cancelled_in_send(d, twice=False),
        asyncio.CancelledError,
        told_node=True,
    ),
    Case(
        "cancelled again while the node is told",
        lambda d: _cancelled_in_send(d, twice=True),
        asyncio.CancelledError,
        told_node=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_a_failure_at_any_step_gives_every_slot_and_queue_place_back(case: Case) -> None:
    dispatcher = new_dispatcher()
    error = await case.inject(dispatcher)
    await settle()

    assert isinstance(error, case.expected), repr(error)
    assert [slot.in_flight for slot in dispatcher.pool.slots()] == [0]
    assert dispatcher.queued(MODEL) == 0
    assert dispatcher.runs_in_flight() == 0
    if case.told_node:
        link = dispatcher.pool.links.get("node-a")
        assert isinstance(link, Link)
        assert len(link.cancelled) == 1  # the node drops a run that may have reached it
        link.gate.set()
        await settle()

    # ... and the next request is served, at full capacity.
    dispatcher.pool.apply_fleet(fleet())
    healthy = Link()
    connect(dispatcher, healthy)
    run = await dispatcher.open_run(spec())
    assert [request.run_id for request in healthy.sent] == [run.run_id]
    assert dispatcher.pool.slot("a").in_flight == 1
    complete(run)
    assert dispatcher.pool.slot("a").in_flight == 0


async def test_the_body_is_sent_with_the_served_name_and_every_other_field_intact() -> None:
    dispatcher = new_dispatcher()
    link = Link()
    connect(dispatcher, link)
    await dispatcher.open_run(spec(seed=7, tools=[{"type": "function"}], note="é\ud83d"))
    [request] = link.sent
    assert json_codec.loads(request.body_json) == {
        "model": "served-m",
        "messages": [{"role": "user", "content": "hi"}],
        "seed": 7,
        "tools": [{"type": "function"}],
        "note": "é\ud83d",
    }


async def test_a_run_that_fits_the_frame_exactly_is_sent() -> None:
    dispatcher = new_dispatcher()
    link = Link(frame_limit=FRAME)
    connect(dispatcher, link)
    # The dispatcher's bound holds for the real encoding: what it lets through fits.
    size = FRAME - 6 * 1024
    await dispatcher.open_run(spec(blob="x" * size))
    assert len(link.sent) == 1
    with pytest.raises(RequestTooLarge, match=f"limit of {FRAME} bytes"):
        await dispatcher.open_run(spec(blob="x" * (FRAME - 1024)))


@pytest.mark.parametrize(
    ("operation", "field", "value", "code"),
    [
        (Operation.CHAT_COMPLETIONS, "max_tokens", 2**31, "integer_above_max_value"),
        (Operation.CHAT_COMPLETIONS, "max_completion_tokens", 2**64, "integer_above_max_value"),
        (Operation.COMPLETIONS, "max_tokens", 0, "integer_below_min_value"),
        (Operation.CHAT_COMPLETIONS, "max_tokens", -5, "integer_below_min_value"),
        (Operation.CHAT_COMPLETIONS, "max_tokens", "10", "invalid_type"),
        (Operation.CHAT_COMPLETIONS, "max_tokens", 10.0, "invalid_type"),
        (Operation.COMPLETIONS, "max_tokens", True, "invalid_type"),
    ],
)
async def test_output_lengths_not_positive_integers_below_2_to_the_31_are_refused(
    operation: Operation, field: str, value: object, code: str
) -> None:
    dispatcher = new_dispatcher()  # the model's cap: 100
    connect(dispatcher, Link())
    body = {"model": MODEL, "prompt": "x", "messages": [], field: value}
    with pytest.raises(InvalidRequest) as refused:
        await dispatcher.open_run(RunSpec(MODEL, operation, body, False, False))
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, code)
    assert dispatcher.pool.slot("a").in_flight == 0


@pytest.mark.parametrize(
    ("operation", "field", "value", "code"),
    [
        (Operation.CHAT_COMPLETIONS, "top_logprobs", 21, "integer_above_max_value"),
        (Operation.CHAT_COMPLETIONS, "n_probs", 100_000, "integer_above_max_value"),
        (Operation.COMPLETIONS, "logprobs", 21, "integer_above_max_value"),
        (Operation.COMPLETIONS, "n", 2, "integer_above_max_value"),  # a batch line's n
        (Operation.COMPLETIONS, "best_of", 3, "integer_above_max_value"),
        (Operation.CHAT_COMPLETIONS, "prompt_logprobs", -1, "integer_below_min_value"),
        (Operation.CHAT_COMPLETIONS, "top_logprobs", "5", "invalid_type"),
        (Operation.COMPLETIONS, "logprobs", 2.0, "invalid_type"),
    ],
)
async def test_fields_that_multiply_an_answer_are_capped_before_a_slot(
    operation: Operation, field: str, value: object, code: str
) -> None:
    dispatcher = new_dispatcher()
    connect(dispatcher, Link())
    body = {"model": MODEL, "prompt": "x", "messages": [], field: value}
    with pytest.raises(InvalidRequest) as refused:
        await dispatcher.open_run(RunSpec(MODEL, operation, body, False, False))
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, code)
    assert dispatcher.pool.slot("a").in_flight == 0


async def test_answer_size_fields_within_their_caps_are_served() -> None:
    dispatcher = new_dispatcher()
    link = Link()
    connect(dispatcher, link)
    complete(await dispatcher.open_run(spec(logprobs=True, top_logprobs=20, n_probs=20, n=1)))
    complete(await dispatcher.open_run(spec(logprobs=False, top_logprobs=None, best_of=1)))
    embeddings = RunSpec(MODEL, Operation.EMBEDDINGS, {"model": MODEL, "n": 10}, False, False)
    complete(await dispatcher.open_run(embeddings))  # no answer of tokens to multiply
    assert len(link.sent) == 3


async def test_output_lengths_within_the_cap_and_null_are_served() -> None:
    dispatcher = new_dispatcher()
    link = Link()
    connect(dispatcher, link)
    for value in (1, 100, None):
        complete(await dispatcher.open_run(spec(max_tokens=value, max_completion_tokens=value)))
    embeddings = RunSpec(
        MODEL, Operation.EMBEDDINGS, {"model": MODEL, "max_tokens": 10**9}, False, False
    )
    complete(await dispatcher.open_run(embeddings))  # no output length to cap
    assert len(link.sent) == 4


async def test_output_lengths_past_the_models_cap_are_lowered_to_it() -> None:
    # What a batch line (which has no HTTP pipeline in front) gets: the same rule.
    dispatcher = new_dispatcher()  # the model's cap: 100
    link = Link()
    connect(dispatcher, link)
    asked = spec(max_tokens=101, max_completion_tokens=2**31 - 1)
    complete(await dispatcher.open_run(asked))
    sent = json_codec.loads(link.sent[0].body_json)
    assert (sent["max_tokens"], sent["max_completion_tokens"]) == (100, 100)
    assert asked.body["max_tokens"] == 101  # the client's body is never changed in place


@pytest.mark.parametrize(
    ("body", "served"),
    [
        ({"model": MODEL}, "s"),
        ({"model": MODEL, "a": [1, {"b": "é"}], "n": None}, 'quote"d/name:q4'),
        ({"messages": [], "model": MODEL, "x": "\ud83d", "big": 2**70}, "é"),  # slow path
    ],
)
def test_the_run_body_is_measured_exactly_and_reads_back(
    body: dict[str, object], served: str
) -> None:
    run_body = RunBody(body, [served])
    written, _, _ = run_body.for_provider("mock", served, Operation.CHAT_COMPLETIONS, False)
    needed = len(written) + len(served.encode()) + SWITCHES_SLACK + RUN_FRAME_OVERHEAD
    assert run_body.frame_bytes == needed
    assert json_codec.loads(written) == {**body, "model": served}
