"""RunExecutor with small fakes: the events, the history rows and the metrics of one run."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from iop_node.domain.admission import AdmissionGate
from iop_node.domain.events import Failed, Started
from iop_node.domain.health import Health, ProbeResult
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, ExecutionSpec, Operation, Usage
from iop_node.errors import (
    ContextLengthExceeded,
    ErrorCode,
    ProviderUnavailable,
    RunCancelled,
    RunFailure,
)
from iop_node.metrics import NodeMetrics
from iop_node.ports import EventSink, LifecycleFlags, RunRecord
from iop_node.runtime import ProviderRuntime
from iop_node.service.runs import RunExecutor
from iop_proto import json_codec
from iop_proto.prefix import body_blocks

CONFIG = ProviderConfig(id="p1", type="fake", models=("m",), capacity=1, max_queue=0)


@dataclass
class History:
    started: list[RunRecord] = field(default_factory=list)
    completed: list[RunRecord] = field(default_factory=list)
    a_run_started: asyncio.Event = field(default_factory=asyncio.Event)

    def run_started(self, record: RunRecord) -> None:
        self.started.append(record)
        self.a_run_started.set()

    def complete_run(self, record: RunRecord) -> None:
        self.completed.append(record)

    async def recent(self, limit: int) -> list[RunRecord]:
        return []


@dataclass
class Channel:
    events: list[tuple[object, ...]] = field(default_factory=list)
    context: tuple[int, int] = (0, 0)  # a failure's context window and prompt tokens
    provider_statuses: list[int] = field(default_factory=list)
    first_token_ms: int = 0

    def started(self, event: Started) -> None:
        self.events.append(("started", event.provider_id, event.target, event.queue_wait_ms))

    async def delta(self, delta: Delta) -> None:
        if not self.first_token_ms:
            self.first_token_ms = time.time_ns() // 1_000_000
        self.events.append(("delta", delta.text))

    async def completed(self, completion: Completion) -> None:
        self.events.append(("completed", completion.finish_reason))

    async def failed(self, failure: Failed) -> None:
        self.events.append(("failed", failure.code, failure.message))
        self.context = (failure.context_window, failure.prompt_tokens)
        self.provider_statuses.append(failure.provider_status)


@dataclass
class Adapter:
    """Streams ``texts``, then returns ``completion`` or raises ``failure``."""

    texts: tuple[str, ...] = ()
    completion: Completion = field(default_factory=Completion)
    failure: RunFailure | None = None
    gate: asyncio.Event | None = None

    @property
    def name(self) -> str:
        return "fake"

    def capabilities(self) -> LifecycleFlags:
        return LifecycleFlags()

    async def probe(self) -> ProbeResult:
        return ProbeResult(ok=True)

    async def aclose(self) -> None:
        pass

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        if self.gate is not None:
            await self.gate.wait()
        for text in self.texts:
            await sink.delta(Delta(text=text))
        if self.failure is not None:
            raise self.failure
        return self.completion


@dataclass
class Setup:
    history: History
    metrics: NodeMetrics
    registry: CollectorRegistry
    runtime: ProviderRuntime
    executor: RunExecutor

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"provider": "p1", **labels})


def setup(adapter: Adapter) -> Setup:
    registry = CollectorRegistry()
    metrics = NodeMetrics.create(registry)
    history = History()
    runtime = ProviderRuntime(CONFIG, adapter, AdmissionGate("p1", 1, 0))
    runtime.publish(metrics)
    return Setup(history, metrics, registry, runtime, RunExecutor(history, metrics, lambda: None))


def spec(run_id: str = "r1", *, stream: bool = True) -> ExecutionSpec:
    return ExecutionSpec(
        run_id=run_id,
        model="public",
        provider_id="p1",
        adapter="fake",
        target="m",
        operation=Operation.CHAT_COMPLETIONS,
        body_json=b'{"model": "m"}',
        stream=stream,
        include_usage=True,
        deadline=asyncio.get_running_loop().time() + 10,
    )


async def test_a_completed_run_its_events_history_and_metrics() -> None:
    usage = Usage(3, 2, 5, cached_tokens=1)
    adapter = Adapter(texts=("a", "b"), completion=Completion("stop", usage))
    s = setup(adapter)
    channel = Channel()
    await s.executor.execute_run(s.runtime, spec(), channel)

    assert channel.events == [
        ("started", "p1", "m", 0),
        ("delta", "a"),
        ("delta", "b"),
        ("completed", "stop"),
    ]
    (started,) = s.history.started
    (final,) = s.history.completed
    assert started == RunRecord(
        "r1",
        "public",
        "p1",
        "m",
        "chat_completions",
        True,
        "running",
        received_ms=started.received_ms,
        started_ms=started.started_ms,
    )
    assert 0 < started.received_ms <= started.started_ms
    assert final.outcome == "completed"
    assert (final.error_code, final.error_message) == ("", "")
    assert (final.received_ms, final.started_ms) == (started.received_ms, started.started_ms)
    assert started.started_ms <= final.first_token_ms <= final.finished_ms
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (3, 2, 1)

    assert s.value("iop_node_runs_total", outcome="completed", code="ok") == 1
    assert s.value("iop_node_tokens_total", kind="prompt") == 3
    assert s.value("iop_node_tokens_total", kind="completion") == 2
    assert s.value("iop_node_tokens_total", kind="cached") == 1
    assert s.value("iop_node_queue_wait_seconds_count") == 1
    assert s.value("iop_node_service_seconds_count") == 1
    assert s.value("iop_node_provider_in_flight") == 0
    assert s.value("iop_node_provider_health", state="unknown") == 1


async def test_an_unreachable_provider_fails_the_run_and_is_published_unavailable() -> None:
    s = setup(Adapter(failure=ProviderUnavailable("connection refused")))
    channel = Channel()
    await s.executor.execute_run(s.runtime, spec(), channel)

    assert [e[0] for e in channel.events] == ["started", "failed"]
    (final,) = s.history.completed
    assert (final.outcome, final.error_code) == ("failed", "provider_unavailable")
    assert final.error_message == "connection refused"
    assert final.first_token_ms == 0
    assert s.runtime.health.state is Health.UNAVAILABLE
    assert s.value("iop_node_provider_health", state="unavailable") == 1
    assert s.value("iop_node_provider_health", state="unknown") == 0
    assert s.value("iop_node_runs_total", outcome="failed", code="provider_unavailable") == 1
    assert s.value("iop_node_tokens_total", kind="prompt") is None


async def test_a_context_overflow_reaches_the_edge_with_its_numbers_and_keeps_health() -> None:
    failure = ContextLengthExceeded(
        "HTTP 400: too long", provider_status=400, context_window=512, prompt_tokens=900
    )
    s = setup(Adapter(failure=failure))
    channel = Channel()
    await s.executor.execute_run(s.runtime, spec(), channel)

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert channel.events[-1] == ("failed", code, "HTTP 400: too long")
    assert channel.context == (512, 900)
    (final,) = s.history.completed
    assert (final.outcome, final.error_code) == ("failed", "context_length_exceeded")
    assert s.runtime.health.state is Health.UNKNOWN  # the client's fault, not the provider's


async def test_a_run_refused_by_a_full_queue_never_started() -> None:
    gate = asyncio.Event()
    s = setup(Adapter(gate=gate))
    first = asyncio.create_task(s.executor.execute_run(s.runtime, spec("r1"), Channel()))
    await s.history.a_run_started.wait()
    channel = Channel()
    await s.executor.execute_run(s.runtime, spec("r2"), channel)  # capacity 1, no queue
    gate.set()
    await first

    assert [e[0] for e in channel.events] == ["failed"]
    assert [r.run_id for r in s.history.started] == ["r1"]
    rejected = next(r for r in s.history.completed if r.run_id == "r2")
    assert (rejected.outcome, rejected.error_code) == ("rejected", "queue_full")
    assert rejected.started_ms == 0
    assert rejected.finished_ms >= rejected.received_ms > 0
    assert s.value("iop_node_runs_total", outcome="rejected", code="queue_full") == 1
    assert s.value("iop_node_service_seconds_count") == 1  # r1 only


async def test_a_cancelled_run_is_recorded_and_reraises() -> None:
    gate = asyncio.Event()
    s = setup(Adapter(gate=gate))
    channel = Channel()
    task = asyncio.create_task(s.executor.execute_run(s.runtime, spec(), channel))
    await s.history.a_run_started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (final,) = s.history.completed
    assert (final.outcome, final.error_code, final.error_message) == (
        "cancelled",
        "cancelled",
        "cancelled",
    )
    assert s.runtime.gate.in_flight == 0
    assert s.value("iop_node_provider_in_flight") == 0


async def test_the_load_gauges_show_a_run_while_it_runs() -> None:
    gate = asyncio.Event()
    s = setup(Adapter(gate=gate))
    task = asyncio.create_task(s.executor.execute_run(s.runtime, spec(), Channel()))
    await s.history.a_run_started.wait()
    # read at the scrape: the run holds its slot now, not only once it has ended
    assert s.value("iop_node_provider_in_flight") == 1
    assert s.value("iop_node_provider_capacity") == 1
    gate.set()
    await task
    assert s.value("iop_node_provider_in_flight") == 0
    s.metrics.forget("p1")
    assert s.value("iop_node_provider_in_flight") is None


@dataclass
class GoneChannel(Channel):
    """The edge connection is gone: every send fails the way ``ConnectionChannel``'s do."""

    async def delta(self, delta: Delta) -> None:
        raise RunCancelled("the edge connection is gone")


async def test_a_lost_edge_is_one_record_whether_the_run_was_sending_or_waiting() -> None:
    sending = setup(Adapter(texts=("a",)))
    await sending.executor.execute_run(sending.runtime, spec("sending"), GoneChannel())

    waiting = setup(Adapter(gate=asyncio.Event()))
    task = asyncio.create_task(waiting.executor.execute_run(waiting.runtime, spec(), Channel()))
    await waiting.history.a_run_started.wait()
    task.cancel("the edge connection is gone")  # what the link's cancel_all passes
    with pytest.raises(asyncio.CancelledError):
        await task

    records = [*sending.history.completed, *waiting.history.completed]
    assert {(r.outcome, r.error_code, r.error_message) for r in records} == {
        ("cancelled", "cancelled", "the edge connection is gone")
    }
    for s in (sending, waiting):
        assert s.value("iop_node_runs_total", outcome="cancelled", code="cancelled") == 1


@dataclass
class CountingAdapter(Adapter):
    """An adapter whose provider has a tokenizer (``TokenCounter``)."""

    counted: int = 7

    async def count_tokens(self, spec: ExecutionSpec) -> Completion:
        return Completion(usage=Usage(self.counted, 0, self.counted))


def count_spec(run_id: str) -> ExecutionSpec:
    return dataclasses.replace(spec(run_id, stream=False), operation=Operation.COUNT_TOKENS)


async def test_count_tokens_runs_outside_the_capacity_gate() -> None:
    """The one slot is busy and there is no queue: a generation would be refused, a
    count is answered by the tokenizer beside it."""
    gate = asyncio.Event()
    s = setup(CountingAdapter(gate=gate))
    first = asyncio.create_task(s.executor.execute_run(s.runtime, spec("r1"), Channel()))
    await s.history.a_run_started.wait()
    channel = Channel()
    await s.executor.execute_run(s.runtime, count_spec("r2"), channel)
    assert channel.events == [("started", "p1", "m", 0), ("completed", "")]
    assert s.runtime.gate.in_flight == 1  # r1's slot, never r2's
    gate.set()
    await first
    counted = next(r for r in s.history.completed if r.run_id == "r2")
    assert (counted.outcome, counted.operation, counted.prompt_tokens) == (
        "completed",
        "count_tokens",
        7,
    )


async def test_count_tokens_on_an_adapter_without_a_tokenizer_is_not_offered() -> None:
    s = setup(Adapter())
    channel = Channel()
    await s.executor.execute_run(s.runtime, count_spec("r1"), channel)
    assert channel.provider_statuses == [501]  # the edge stops choosing it for count_tokens
    (final,) = s.history.completed
    assert (final.outcome, final.error_code) == ("failed", "invalid_request")


LONG_PROMPT = {"model": "m", "messages": [{"role": "user", "content": "a long question " * 64}]}


def prompt_spec(run_id: str, operation: Operation = Operation.CHAT_COMPLETIONS) -> ExecutionSpec:
    body_json = json_codec.dumps(LONG_PROMPT)
    return dataclasses.replace(spec(run_id), operation=operation, body_json=body_json)


@dataclass
class LoadChannel(Channel):
    """Notes the provider's load and cached prompts as each event is sent: what the
    link's channel puts on the run's end (``ProviderLoad``) or a snapshot then reports."""

    runtime: ProviderRuntime | None = None
    seen: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)

    def _note(self) -> None:
        assert self.runtime is not None
        self.seen.append((self.runtime.gate.in_flight, self.runtime.cache.view.prefixes))

    def started(self, event: Started) -> None:
        self._note()
        super().started(event)

    async def completed(self, completion: Completion) -> None:
        self._note()
        await super().completed(completion)


async def test_a_served_prompt_is_in_the_account_before_its_slot_is_free() -> None:
    """The run's end the edge hears of (its load, or the snapshot it asks for) shows the
    slot free and already names the prompt: the conversation's next turn is routed here
    from that report on. A run's start and end ask for no snapshot of their own (the
    run's events carry its load); only a health change does."""
    usage = Usage(300, 2, 302, cached_tokens=280, prefill_ms_per_token=1.5)
    adapter = Adapter(completion=Completion("stop", usage))
    s = setup(adapter)
    changes: list[int] = []
    executor = RunExecutor(s.history, s.metrics, lambda: changes.append(1))
    channel = LoadChannel(runtime=s.runtime)
    await executor.execute_run(s.runtime, prompt_spec("r1"), channel)

    chain = body_blocks(LONG_PROMPT)
    assert len(chain) == 4
    held = ((chain[-1], 4),)
    assert channel.seen == [(1, ()), (0, held)]  # slot taken, ended
    assert changes == []
    view = s.runtime.cache.view
    assert (view.prompt_tokens, view.cached_tokens) == (300, 280)
    assert view.prefill_ms_per_token == pytest.approx(1.5)


async def test_completions_are_accounted_and_embeddings_are_not() -> None:
    completions = {"model": "m", "prompt": "p" * 600}
    s = setup(Adapter(completion=Completion("stop", Usage(150, 1, 151))))
    embed = dataclasses.replace(prompt_spec("r1"), operation=Operation.EMBEDDINGS)
    await s.executor.execute_run(s.runtime, embed, Channel())
    assert s.runtime.cache.view.prefixes == ()
    assert s.runtime.cache.view.prompt_tokens == 0
    text = dataclasses.replace(
        spec("r2"), operation=Operation.COMPLETIONS, body_json=json_codec.dumps(completions)
    )
    await s.executor.execute_run(s.runtime, text, Channel())
    assert s.runtime.cache.view.prefixes == ((body_blocks(completions)[-1], 2),)


async def test_a_failed_run_is_not_accounted() -> None:
    failure = ContextLengthExceeded("too long", context_window=8, prompt_tokens=9)
    s = setup(Adapter(failure=failure))
    await s.executor.execute_run(s.runtime, prompt_spec("r1"), Channel())
    assert s.runtime.cache.view.prefixes == ()


async def test_an_unreachable_provider_forgets_what_its_engine_held() -> None:
    adapter = Adapter(completion=Completion("stop", Usage(300, 2, 302)))
    s = setup(adapter)
    await s.executor.execute_run(s.runtime, prompt_spec("r1"), Channel())
    assert s.runtime.cache.view.prefixes
    adapter.failure = ProviderUnavailable("connection refused")
    await s.executor.execute_run(s.runtime, prompt_spec("r2"), Channel())
    assert s.runtime.cache.view.prefixes == ()
    assert s.runtime.cache.view.prompt_tokens == 300  # the totals count what was served


async def test_one_deadline_scope_a_run_queued_past_its_queue_timeout() -> None:
    """Queued behind a busy slot, the run's one scope ends at the queue timeout: the
    run is refused as ``queue_timeout`` and leaves the queue; the slot is untouched."""
    gate = asyncio.Event()
    s = setup(Adapter(gate=gate))
    s.runtime.config = dataclasses.replace(CONFIG, max_queue=1, queue_timeout_ms=20)
    s.runtime.gate.resize(1, 1)
    first = asyncio.create_task(s.executor.execute_run(s.runtime, spec("r1"), Channel()))
    await s.history.a_run_started.wait()
    channel = Channel()
    await s.executor.execute_run(s.runtime, spec("r2"), channel)
    assert channel.events == [
        ("failed", ErrorCode.QUEUE_TIMEOUT, "provider p1: no slot free within 20 ms")
    ]
    assert (s.runtime.gate.in_flight, s.runtime.gate.queued) == (1, 0)
    gate.set()
    await first
    refused = next(r for r in s.history.completed if r.run_id == "r2")
    assert (refused.outcome, refused.error_code) == ("rejected", "queue_timeout")


async def test_one_deadline_scope_the_deadline_bounds_the_queue_wait_too() -> None:
    """A deadline earlier than the queue timeout ends the wait: still ``queue_timeout``."""
    gate = asyncio.Event()
    s = setup(Adapter(gate=gate))
    s.runtime.config = dataclasses.replace(CONFIG, max_queue=1, queue_timeout_ms=60_000)
    s.runtime.gate.resize(1, 1)
    first = asyncio.create_task(s.executor.execute_run(s.runtime, spec("r1"), Channel()))
    await s.history.a_run_started.wait()
    channel = Channel()
    soon = dataclasses.replace(spec("r2"), deadline=asyncio.get_running_loop().time() + 0.05)
    await s.executor.execute_run(s.runtime, soon, channel)
    assert [e[:2] for e in channel.events] == [("failed", ErrorCode.QUEUE_TIMEOUT)]
    gate.set()
    await first


async def test_one_deadline_scope_a_run_with_its_slot_ends_at_the_deadline() -> None:
    """Past the queue (its timeout long gone by then), the same scope is the deadline:
    the run fails ``provider_timeout`` and gives its slot back."""
    s = setup(Adapter(gate=asyncio.Event()))  # never answers
    s.runtime.config = dataclasses.replace(CONFIG, queue_timeout_ms=10)
    channel = Channel()
    late = dataclasses.replace(spec("r1"), deadline=asyncio.get_running_loop().time() + 0.1)
    await s.executor.execute_run(s.runtime, late, channel)
    assert [e[:2] for e in channel.events] == [
        ("started", "p1"),
        ("failed", ErrorCode.PROVIDER_TIMEOUT),
    ]
    assert s.runtime.gate.in_flight == 0
    (final,) = s.history.completed
    assert (final.outcome, final.error_code) == ("failed", "provider_timeout")
