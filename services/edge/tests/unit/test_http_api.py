"""The edge's HTTP API, served for real on 127.0.0.1, driven by the official OpenAI SDK.

The ports behind the API are small fakes written here: a run is a list of
``pb.RunEvent``s (optionally hanging at the end, to test disconnects), so every
test states exactly what the node said and checks exactly what the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import run_event
from iop_edge.domain.events import Completed, Failed, RunEvent, Started
from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry, Operation
from iop_edge.entrypoints.api_auth import KeySlots
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.http_api import API_FRONT, create_api_app, load_openapi
from iop_edge.entrypoints.stop_gate import StopGate
from iop_edge.errors import (
    EdgeError,
    NoProviderAvailable,
    ProviderFailed,
    QueueFull,
    QueueTimeout,
    from_failure,
)
from iop_edge.ports import AttemptRecord, EdgeRunRecord, RunSpec
from iop_proto.service.http_site import CappedSite
from iop_proto.v1 import runtime_pb2 as pb


async def as_events(wire: AsyncIterator[pb.RunEvent]) -> AsyncIterator[RunEvent]:
    """The fake's wire events as the node listener hands them on (converted once)."""
    async for message in wire:
        event = run_event(message)
        if event is not None:
            yield event


CHAT = "llama3.1:8b"  # ids with ':' and '/' must survive routing
EMBED = "org/embed-v1"
OTHER = "qwen/qwen2.5:7b"
SERVED = "served-name-q4"  # what the provider calls it: never shown to a client
WAIT = 5.0  # upper bound on waiting for an explicit signal (never a sleep)

# ---------------------------------------------------------------- fakes of the ports


def usage(prompt: int = 5, completion: int = 2, cached: int = 0) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def start() -> pb.RunEvent:
    return pb.RunEvent(start=pb.RunStart(provider_id="p1", target=SERVED, queue_wait_ms=7))


def delta(text: str = "", **fields: Any) -> pb.RunEvent:
    return pb.RunEvent(delta=pb.RunDelta(text=text, **fields))


def complete(result: dict[str, Any] | None = None, **fields: Any) -> pb.RunEvent:
    body = json.dumps(result).encode() if result is not None else b""
    return pb.RunEvent(complete=pb.RunComplete(result_json=body, **fields))


def run_error(code: int, message: str = "boom") -> pb.RunEvent:
    return pb.RunEvent(error=pb.RunError(code=code, message=message))  # type: ignore[arg-type]


class FakeRun:
    """A run whose events are given; after them it hangs forever, or raises ``fail``."""

    def __init__(
        self, events: list[pb.RunEvent], *, hang: bool = False, fail: Exception | None = None
    ) -> None:
        self.run_id = "run-1"
        self.provider_id = "p1"
        self.node_id = "n1"
        self.target = SERVED
        self.node_wait_ms = 0
        self._events = events
        self._hang = hang
        self._fail = fail
        self.hanging = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.cancel_reasons: list[str] = []
        self._yielded = 0
        self._ended = asyncio.Event()  # cancel(): a hanging run ends with an error event
        self._error: EdgeError | None = None  # what cancel() said the client sees
        self._told_end = False  # its terminal event went to the reader
        self._reading = as_events(self._iterate())
        self.service: FakeService | None = None  # who admitted it (its queue)

    async def open(self) -> None:
        """Dispatched at once, unless the service queues forever: then it waits until
        it is ended (``cancel``) or its task is cancelled, and leaves the queue."""
        service = self.service
        assert service is not None
        if service.queue_forever:
            service.queued.set()
            try:
                await self._ended.wait()
            finally:
                service.left_queue.set()
            raise self._error or ProviderFailed(self.cancel_reasons[0], code="cancelled")
        service.runs.append(self)

    @property
    def ended(self) -> bool:
        return self._told_end or self._ended.is_set()

    def error(self, failed: Failed) -> EdgeError:
        return self._error or from_failure(failed)

    async def next_events(self) -> list[RunEvent]:
        """All given events count as arrived at once (the relay's batching path runs);
        what the run says after them comes alone. A start is the run's to keep, as
        ``RequestRun.deliver`` keeps it."""
        batch: list[RunEvent] = []
        async for event in self._reading:
            start = event.start if isinstance(event, Completed) else event
            if isinstance(start, Started):
                self.node_wait_ms = start.queue_wait_ms
            if not isinstance(event, Started):
                batch.append(event)
            if batch and self._yielded == len(self._events):
                break
        return batch

    async def _iterate(self) -> AsyncIterator[pb.RunEvent]:
        for sequence, event in enumerate(self._events):
            event.run_id, event.sequence = self.run_id, sequence
            self._yielded = sequence + 1
            self._told_end = event.HasField("complete") or event.HasField("error")
            yield event
        if self._fail is not None:
            raise self._fail
        if self._hang:
            self.hanging.set()
            await self._ended.wait()
            yield run_error(pb.ERROR_CODE_CANCELLED, self.cancel_reasons[0])

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        if self._ended.is_set():
            return  # ended already: the first end wins
        self.cancel_reasons.append(reason)
        self._error = error
        self.cancelled.set()
        self._ended.set()

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        return (AttemptRecord(self.run_id, self.provider_id, self.node_id, "completed"),)


def standard_run(spec: RunSpec) -> FakeRun:
    """What a healthy provider says for each operation, streaming or not."""
    if spec.operation is Operation.EMBEDDINGS:
        result: dict[str, Any] = {
            "object": "list",
            "model": SERVED,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1.0]}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
        }
        return FakeRun([start(), complete(result, usage=usage(3, 0))])
    chat = spec.operation is Operation.CHAT_COMPLETIONS
    if spec.stream:
        first = delta("Hel", role="assistant") if chat else delta("Hel")
        return FakeRun(
            [start(), first, delta("lo"), delta(finish_reason="stop"), complete(usage=usage())]
        )
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": "Hello"}
    else:
        choice["text"] = "Hello"
    result = {
        "id": "provider-id",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": SERVED,
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    return FakeRun([start(), complete(result, finish_reason="stop", usage=usage())])


class FakeService:
    """``RunService``: records each spec; ``plan`` makes the run, ``error`` refuses it."""

    def __init__(self) -> None:
        self.specs: list[RunSpec] = []
        self.runs: list[FakeRun] = []
        self.plan: Callable[[RunSpec], FakeRun] = standard_run
        self.error: BaseException | None = None
        self.queue_forever = False
        self.queued = asyncio.Event()
        self.left_queue = asyncio.Event()

    def admit(self, spec: RunSpec) -> FakeRun:
        self.specs.append(spec)
        if self.error is not None:
            raise self.error
        run = self.plan(spec)
        run.service = self
        return run


@dataclass
class FakeCatalog:
    entries: list[ModelEntry]
    available: bool = True
    counts_tokens: bool = False  # a provider with a tokenizer serves the models
    asked_for: list[ApiKeyEntry | None] = field(default_factory=list)  # the views' keys

    def models(self) -> list[ModelEntry]:
        return list(self.entries)

    def model(self, model_id: str) -> ModelEntry | None:
        return next((m for m in self.entries if m.id == model_id), None)

    def provider_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        self.asked_for.append(key)
        return [{"provider_id": "p1", "node_id": "n1", "health": "available"}]

    def model_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        self.asked_for.append(key)
        return [{"id": m.id, "display_name": m.display_name} for m in self.entries]

    def any_available(self) -> bool:
        return self.available

    def offers(self, model_id: str, operation: Operation) -> bool:
        return operation is not Operation.COUNT_TOKENS or self.counts_tokens


@dataclass
class FakeKeys:
    by_key: dict[str, ApiKeyEntry] | None  # None: no keys configured

    configured = True  # a fleet config has arrived

    @property
    def open(self) -> bool:
        return self.by_key is None

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return (self.by_key or {}).get(presented_key)


@dataclass
class FakeRunLog:
    records: list[EdgeRunRecord] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, record: EdgeRunRecord) -> None:
        self.records.append(record)
        self.changed.set()

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        mine = [r for r in self.records if key_id is None or r.key_id == key_id]
        return mine[::-1][:limit]

    async def wait_for(self, count: int) -> list[EdgeRunRecord]:
        async with asyncio.timeout(WAIT):
            while len(self.records) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.records


def key(key_id: str, *models: str, max_concurrent: int = 0, operator: bool = False) -> ApiKeyEntry:
    return ApiKeyEntry(
        key_id, key_id, f"hash-{key_id}", frozenset(models), max_concurrent, operator
    )


@dataclass
class Edge:
    url: str
    service: FakeService
    catalog: FakeCatalog
    runlog: FakeRunLog
    registry: CollectorRegistry
    slots: KeySlots

    def sdk(self, api_key: str = "sk-any") -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def serve(
    keys: dict[str, ApiKeyEntry] | None = None,
    cors_origins: tuple[str, ...] = (),
    max_body_bytes: int | None = None,
    stop_gate: StopGate | None = None,
) -> AsyncIterator[Edge]:
    models = [
        ModelEntry(CHAT, "Llama 3.1 8B", {"p1": SERVED}),
        ModelEntry(EMBED, "Embed v1", {"p1": SERVED}),
        ModelEntry(OTHER, "Qwen 2.5 7B", {"p1": SERVED}),
    ]
    service, catalog, runlog = FakeService(), FakeCatalog(models), FakeRunLog()
    registry, slots = CollectorRegistry(), KeySlots()
    app = create_api_app(
        service,
        catalog,
        FakeKeys(keys),
        runlog,
        ApiMetrics.create(registry),
        openapi=load_openapi(),
        key_slots=slots,
        cors_origins=cors_origins,
        stop_gate=stop_gate,
        **({} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}),
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    front = app[API_FRONT]
    try:
        if SERVED_BY["front"] == "aiohttp":
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
        else:  # bootstrap's wiring: the inference front, the rest handed to aiohttp
            capped = CappedSite(
                runner,
                "127.0.0.1",
                0,
                max_connections=1000,
                protocol_factory=front.protocol_factory,
            )
            await capped.start()
            host, port = "127.0.0.1", capped.port
        yield Edge(f"http://{host}:{port}", service, catalog, runlog, registry, slots)
    finally:
        await front.shutdown(1.0)
        await runner.cleanup()


SERVED_BY = {"front": "aiohttp"}


@pytest.fixture(autouse=True, params=["aiohttp", "front"])
def served_by(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here twice: aiohttp's server alone, and the public port's front
    (``fast_front``) that serves the inference routes and hands the rest to aiohttp."""
    SERVED_BY["front"] = request.param
    yield request.param
    SERVED_BY["front"] = "aiohttp"


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    async with serve() as served:
        yield served


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], **extra}


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking every event is one ``data:`` line."""
    events = text.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
        payloads.append(event.removeprefix("data: "))
    return payloads


# ---------------------------------------------------------------- the OpenAI SDK as client


async def test_chat_stream_with_usage(edge: Edge) -> None:
    async with edge.sdk() as client:
        stream = await client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.model for c in chunks} == {CHAT}
    assert {c.id for c in chunks} == {"chatcmpl-run-1"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.total_tokens) == (5, 7)
    assert edge.service.specs[0].include_usage
    assert edge.service.specs[0].stream


async def test_chat_stream_without_include_usage_has_no_usage_chunk(edge: Edge) -> None:
    async with edge.sdk() as client:
        stream = await client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert all(c.choices and c.usage is None for c in chunks)


async def test_chat_non_stream_returns_the_provider_result_under_the_public_ids(
    edge: Edge,
) -> None:
    async with edge.sdk() as client:
        result = await client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "hi"}]
        )
    assert result.model == CHAT
    assert result.id == "chatcmpl-run-1"  # the edge's, not the provider's "provider-id"
    assert result.choices[0].message.content == "Hello"
    assert result.choices[0].message.refusal is None
    assert "refusal" in result.choices[0].message.model_fields_set  # sent, as null
    assert result.usage is not None
    assert result.usage.total_tokens == 7


async def test_tool_call_deltas_are_reassembled_by_the_sdk(edge: Edge) -> None:
    call = pb.ToolCallDelta
    edge.service.plan = lambda spec: FakeRun(
        [
            start(),
            delta(role="assistant", tool_calls=[call(index=0, id="call_1", type="function")]),
            delta(tool_calls=[call(index=0, function_name="weather", function_arguments="")]),
            delta(tool_calls=[call(index=0, function_arguments='{"city":')]),
            delta(tool_calls=[call(index=0, function_arguments='"Paris"}')]),
            delta(finish_reason="tool_calls"),
            complete(finish_reason="tool_calls", usage=usage()),
        ]
    )
    tool: Any = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
    }
    async with edge.sdk() as client:
        async with client.chat.completions.stream(
            model=CHAT, messages=[{"role": "user", "content": "weather?"}], tools=[tool]
        ) as stream:
            final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.id == "call_1"
    assert tool_call.function.name == "weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert edge.service.specs[0].body["tools"] == [tool]


async def test_completions_stream_and_not(edge: Edge) -> None:
    async with edge.sdk() as client:
        result = await client.completions.create(model=CHAT, prompt="Say hello")
        stream = await client.completions.create(
            model=CHAT, prompt="Say hello", stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert (result.model, result.choices[0].text) == (CHAT, "Hello")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello"
    assert {c.object for c in chunks} == {"text_completion"}
    assert {c.model for c in chunks} == {CHAT}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2


async def test_embeddings(edge: Edge) -> None:
    async with edge.sdk() as client:
        result = await client.embeddings.create(model=EMBED, input="hello", encoding_format="float")
    assert result.model == EMBED
    assert result.data[0].embedding == [0.5, -1.0]
    assert edge.service.specs[0].operation is Operation.EMBEDDINGS


async def test_models_list_and_retrieve_ids_with_colon_and_slash(edge: Edge) -> None:
    async with edge.sdk() as client:
        listed = await client.models.list()
        one = await client.models.retrieve(OTHER)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("no/such:model")
    assert [m.id for m in listed.data] == [CHAT, EMBED, OTHER]
    assert (one.id, one.owned_by, one.created) == (OTHER, "iop", 0)
    assert one.model_extra == {
        "display_name": "Qwen 2.5 7B",
        "max_output_tokens": 32768,  # the default cap; no context window in its fleet entry
        "max_output_length": 32768,
    }
    assert missing.value.code == "model_not_found"


async def test_models_tell_their_context_window_and_output_cap(edge: Edge) -> None:
    entry = edge.catalog.entries[0]
    edge.catalog.entries[0] = dataclasses.replace(
        entry, context_window=8192, max_output_tokens=2048
    )
    async with edge.sdk() as client:
        listed = await client.models.list()
        one = await client.models.retrieve(CHAT)
    limits = {
        "context_window": 8192,  # Codex's model metadata name
        "context_length": 8192,  # opencode's (and OpenRouter's) name
        "max_output_tokens": 2048,
        "max_output_length": 2048,  # opencode's name
    }
    assert (
        listed.data[0].model_extra == one.model_extra == {"display_name": "Llama 3.1 8B", **limits}
    )


# ---------------------------------------------------------------- errors, as the SDK sees them


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": CHAT}, "messages"),
        ({"model": CHAT, "messages": []}, "messages"),
        (chat_body(n=2), "n"),
        (chat_body(stream="yes"), "stream"),
        (chat_body(stream_options={"include_usage": True}), "stream_options"),
        (
            chat_body(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage",
        ),
    ],
)
async def test_invalid_chat_requests_name_the_param(
    edge: Edge, body: dict[str, Any], param: str
) -> None:
    async with edge.sdk() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.post("/chat/completions", body=body, cast_to=object)
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"
    assert edge.service.specs == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": CHAT}, "prompt"),
        ("/v1/embeddings", {"model": EMBED}, "input"),
        ("/v1/embeddings", {"model": EMBED, "input": "x", "stream": True}, "stream"),
    ],
)
async def test_invalid_completion_and_embedding_requests(
    edge: Edge, http: aiohttp.ClientSession, path: str, body: dict[str, Any], param: str
) -> None:
    async with http.post(edge.url + path, json=body) as response:
        assert response.status == 400
        assert (await response.json())["error"]["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'{"model": NaN}'])
async def test_a_body_that_is_not_a_json_object_is_400(
    edge: Edge, http: aiohttp.ClientSession, raw: bytes
) -> None:
    async with http.post(f"{edge.url}/v1/chat/completions", data=raw) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "nested",
    [
        "[" * 1000 + "]" * 1000,  # reads with orjson, but no longer writes
        '{"a":' * 64 + "1" + "}" * 64,  # 67 levels, counting the body, messages, a message
    ],
)
async def test_a_body_nested_past_the_limit_is_400_naming_it_and_never_dispatched(
    edge: Edge, http: aiohttp.ClientSession, nested: str
) -> None:
    raw = f'{{"model": "{CHAT}", "messages": [{{"role": "user", "content": {nested}}}]}}'
    async with http.post(f"{edge.url}/v1/chat/completions", data=raw) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "nested deeper than 64 levels" in error["message"]
    assert edge.service.specs == []


async def test_a_body_nested_within_the_limit_is_served(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    schema = '{"type":"object","properties":{"a":' * 20 + "{}" + "}}" * 20
    body = json.loads(schema)
    sent = {**chat_body(), "tools": [{"type": "function", "function": {"parameters": body}}]}
    async with http.post(f"{edge.url}/v1/chat/completions", json=sent) as response:
        assert response.status == 200
    assert edge.service.specs[0].body["tools"] == sent["tools"]


async def test_keys_401_for_missing_or_unknown_and_403_for_a_model_not_allowed() -> None:
    async with serve({"sk-chat": key("k1", CHAT)}) as edge:
        async with edge.sdk("sk-wrong") as client:
            with pytest.raises(openai.AuthenticationError) as unknown:
                await client.chat.completions.create(model=CHAT, messages=[])
        async with edge.sdk("sk-chat") as client:
            with pytest.raises(openai.PermissionDeniedError) as denied:
                await client.embeddings.create(model=EMBED, input="x")
            with pytest.raises(openai.PermissionDeniedError):
                await client.embeddings.create(model="does-not-exist", input="x")
            ok = await client.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": "hi"}]
            )
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{edge.url}/v1/models") as response:
                assert response.status == 401
    assert unknown.value.code == "invalid_api_key"
    assert denied.value.code == "model_not_allowed"
    assert ok.model == CHAT
    assert len(edge.service.specs) == 1


async def test_unknown_model_is_404_before_dispatch(edge: Edge) -> None:
    async with edge.sdk() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(
                model="gpt-nope", messages=[{"role": "user", "content": "hi"}]
            )
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    assert edge.service.specs == []


async def test_queue_full_is_429_with_retry_after(edge: Edge, http: aiohttp.ClientSession) -> None:
    edge.service.error = QueueFull("the queue of llama3.1:8b is full")
    async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body()) as response:
        assert response.status == 429
        assert response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["code"] == "queue_full"
    async with edge.sdk() as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model=CHAT, messages=chat_body()["messages"])
    assert caught.value.type == "rate_limit_error"
    assert len(edge.service.specs) == 2  # max_retries=0: the SDK did not try again


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NoProviderAvailable("no provider of llama3.1:8b is available"), "no_provider_available"),
        (QueueTimeout("waited 30 s in the queue"), "queue_timeout"),
    ],
)
async def test_dispatch_failures_are_503(edge: Edge, error: EdgeError, code: str) -> None:
    edge.service.error = error
    async with edge.sdk() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=CHAT, messages=chat_body()["messages"])
    assert (caught.value.status_code, caught.value.code) == (503, code)
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status, record.error_code) == ("rejected", 503, code)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_error_before_any_delta_is_a_real_http_error(edge: Edge, stream: bool) -> None:
    edge.service.plan = lambda spec: FakeRun(
        [start(), run_error(pb.ERROR_CODE_PROVIDER_TIMEOUT, "no answer in 60 s")]
    )
    async with edge.sdk() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model=CHAT, messages=chat_body()["messages"], stream=stream
            )
    assert (caught.value.status_code, caught.value.code) == (504, "provider_timeout")
    assert "no answer in 60 s" in caught.value.message
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status, record.run_id) == ("failed", 504, "run-1")
    assert edge.service.runs[0].cancel_reasons == []  # the run had ended


def context_overflow(window: int = 256, prompt: int = 431) -> pb.RunEvent:
    """What a node sends for llama.cpp's ``exceed_context_size_error``."""
    said = f"HTTP 400: request ({prompt} tokens) exceeds the available context size"
    error = pb.RunError(
        code=pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
        message=said,
        provider_status=400,
        context_window=window,
        prompt_tokens=prompt,
    )
    return pb.RunEvent(error=error)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_past_the_context_is_openais_context_length_exceeded(
    edge: Edge, http: aiohttp.ClientSession, stream: bool
) -> None:
    edge.service.plan = lambda spec: FakeRun([start(), context_overflow()])
    async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body(stream=stream)) as resp:
        assert resp.status == 400
        assert await resp.json() == {
            "error": {
                "message": "This model's maximum context length is 256 tokens. However, your "
                "messages resulted in 431 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    async with edge.sdk() as client:  # the SDK's own reading of it
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=CHAT, prompt="x" * 2000, stream=stream)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")
    records = await edge.runlog.wait_for(2)
    assert {(r.status, r.error_code) for r in records} == {(400, "context_length_exceeded")}


async def test_a_prompt_past_the_context_is_anthropics_prompt_too_long(edge: Edge) -> None:
    edge.service.plan = lambda spec: FakeRun([start(), context_overflow(200, 90)])
    hello = [{"role": "user", "content": "hi"}]
    async with anthropic_sdk(edge) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model=CHAT, max_tokens=8, messages=hello)
        assert caught.value.body == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "input length and `max_tokens` exceed context limit: 90 + max_tokens"
                " > 200, decrease input length or `max_tokens` and try again",
            },
        }
        edge.service.plan = lambda spec: FakeRun([start(), context_overflow(200, 900)])
        with pytest.raises(anthropic.BadRequestError) as caught:
            async with client.messages.stream(model=CHAT, max_tokens=8, messages=hello) as s:
                await s.get_final_message()
        error: Any = caught.value.body
        assert error["error"]["message"] == "prompt is too long: 900 tokens > 200 maximum"


async def test_a_run_error_mid_stream_is_an_sse_error_event(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.service.plan = lambda spec: FakeRun(
        [start(), delta("Hel", role="assistant"), run_error(pb.ERROR_CODE_PROVIDER_ERROR)]
    )
    async with edge.sdk() as client:
        stream = await client.chat.completions.create(
            model=CHAT, messages=chat_body()["messages"], stream=True
        )
        with pytest.raises(openai.APIError) as caught:
            async for _ in stream:
                pass
    assert caught.value.code == "provider_error"
    async with http.post(
        f"{edge.url}/v1/chat/completions", json=chat_body(stream=True)
    ) as response:
        assert response.status == 200
        payloads = sse_data(await response.text())
    assert json.loads(payloads[-2]) == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "provider_error",
        }
    }
    assert payloads[-1] == "[DONE]"
    records = await edge.runlog.wait_for(2)
    assert {(r.outcome, r.status, r.error_code) for r in records} == {
        ("failed", 200, "provider_error")
    }


# ---------------------------------------------------------------- the wire, read raw


async def test_sse_framing_chunk_by_chunk(edge: Edge, http: aiohttp.ClientSession) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    async with http.post(f"{edge.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        assert response.headers["Cache-Control"] == "no-cache"
        assert response.headers["X-Request-Id"] == "run-1"
        text = await response.text()
    payloads = sse_data(text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert chunks[0] == {
        "id": "chatcmpl-run-1",
        "object": "chat.completion.chunk",
        "created": chunks[0]["created"],
        "model": CHAT,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Hel"},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,  # include_usage: null on every chunk but the last
    }
    assert [c["usage"] for c in chunks[:3]] == [None, None, None]
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(chunks) == 4  # the finish came in a delta: no extra closing chunk


async def test_a_finish_reason_known_only_at_complete_gets_a_closing_chunk(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.service.plan = lambda spec: FakeRun(
        [start(), delta("Hi"), complete(finish_reason="length", usage=usage())]
    )
    async with http.post(
        f"{edge.url}/v1/chat/completions", json=chat_body(stream=True)
    ) as response:
        chunks = [json.loads(p) for p in sse_data(await response.text())[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "Hi"},  # the role is added when the node sent none
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]


async def test_the_client_never_sees_the_served_name(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    for body in (chat_body(), chat_body(stream=True)):
        async with http.post(f"{edge.url}/v1/chat/completions", json=body) as response:
            text = await response.text()
        assert SERVED not in text
        assert CHAT in text


async def test_a_result_without_result_json_is_built_from_deltas(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    call = pb.ToolCallDelta(index=0, id="c1", type="function", function_name="f")
    edge.service.plan = lambda spec: FakeRun(
        [
            start(),
            delta("Hel", role="assistant", reasoning_text="think"),
            delta("lo", tool_calls=[call]),
            delta(tool_calls=[pb.ToolCallDelta(index=0, function_arguments="{}")]),
            complete(finish_reason="stop", usage=usage()),
        ]
    )
    async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body()) as response:
        result = await response.json()
    assert result["id"] == "chatcmpl-run-1"
    assert result["object"] == "chat.completion"
    assert result["model"] == CHAT
    assert result["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Hello",
                "refusal": None,
                "reasoning_content": "think",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert result["usage"]["total_tokens"] == 7


async def test_unknown_params_reach_the_run_spec_untouched(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    body = chat_body(
        seed=42,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True}},
        vendor_extension={"top_k": 40, "ids": [1, 2, 3], "big": 12345678901234567890 * 10**9},
        temperature=0.25,
    )
    async with http.post(f"{edge.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
    (spec,) = edge.service.specs
    assert spec.body == body
    assert type(spec.body["vendor_extension"]["big"]) is int  # past 64 bits: kept exact
    assert (spec.model, spec.stream, spec.include_usage) == (CHAT, False, False)


async def test_one_record_per_request(edge: Edge, http: aiohttp.ClientSession) -> None:
    url = f"{edge.url}/v1/chat/completions"
    for body in (chat_body(), chat_body(stream=True), chat_body(model="nope"), {"x": 1}):
        async with http.post(url, json=body) as response:
            await response.read()
    records = await edge.runlog.wait_for(4)
    assert len(records) == 4
    assert [(r.outcome, r.status, r.stream) for r in records] == [
        ("completed", 200, False),
        ("completed", 200, True),
        ("rejected", 404, False),
        ("rejected", 400, False),
    ]
    done = records[1]
    assert (done.run_id, done.model, done.provider_id, done.node_id) == ("run-1", CHAT, "p1", "n1")
    assert (done.prompt_tokens, done.completion_tokens) == (5, 2)
    assert done.queue_wait_ms >= 7
    assert done.received_ms > 0
    assert 1 <= done.ttft_ms <= done.duration_ms
    assert records[0].ttft_ms == 0  # a non-streaming run sent no delta
    assert records[2].model == ""
    assert records[2].run_id.startswith("req-")
    requests = "iop_edge_requests_total"
    api = {"key": "", "api": "chat_completions"}  # the API is open: no key
    assert edge.metric(requests, model=CHAT, status="200", provider="p1", **api) == 2
    assert edge.metric(requests, model="", status="404", provider="", **api) == 1
    assert edge.metric("iop_edge_requests_in_flight", model=CHAT) == 0
    assert edge.metric("iop_edge_queue_wait_seconds_count", model=CHAT) == 2


async def test_cached_tokens_reach_the_sdk_the_record_and_the_metrics(edge: Edge) -> None:
    edge.service.plan = lambda spec: FakeRun(
        [start(), delta("Hi", role="assistant"), complete(usage=usage(40, 2, cached=32))]
    )
    async with edge.sdk() as client:
        stream = await client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    last = chunks[-1].usage
    assert last is not None
    assert last.prompt_tokens_details is not None
    assert (last.prompt_tokens, last.prompt_tokens_details.cached_tokens) == (40, 32)
    (record,) = await edge.runlog.wait_for(1)
    assert (record.prompt_tokens, record.cached_tokens) == (40, 32)
    tokens = "iop_edge_tokens_total"
    api = {"key": "", "api": "chat_completions"}  # the API is open: no key
    assert edge.metric(tokens, model=CHAT, provider="p1", kind="prompt", **api) == 40
    assert edge.metric(tokens, model=CHAT, provider="p1", kind="completion", **api) == 2
    assert edge.metric(tokens, model=CHAT, provider="p1", kind="cached", **api) == 32


async def test_a_folded_completion_is_answered_and_recorded_as_three_events_are(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    """A node that finished the run within its acknowledgement hold sends one event: the
    completion with the start in it. The answer and the record are those of three."""
    result = {
        "object": "chat.completion",
        "model": SERVED,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "Hello"},
            }
        ],
    }
    folded = complete(result, finish_reason="stop", usage=usage(), start=start().start)
    edge.service.plan = lambda spec: FakeRun([folded])
    async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body()) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["choices"][0]["message"]["content"] == "Hello"
    [record] = await edge.runlog.wait_for(1)
    assert (record.outcome, record.provider_id) == ("completed", "p1")
    assert record.queue_wait_ms >= 7  # the node's queue wait, from the folded start
    assert edge.metric("iop_edge_queue_wait_seconds_count", model=CHAT) == 1


# ---------------------------------------------------------------- disconnects cancel the run


async def test_disconnect_mid_stream_cancels_the_run(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    run = FakeRun([start(), delta("Hel", role="assistant")], hang=True)
    edge.service.plan = lambda spec: run
    response = await http.post(f"{edge.url}/v1/chat/completions", json=chat_body(stream=True))
    assert response.status == 200
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
    response.close()  # the client goes away mid-stream
    async with asyncio.timeout(WAIT):
        await run.cancelled.wait()
    assert run.cancel_reasons == ["client disconnected"]
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status, record.error_code) == (
        "cancelled",
        200,
        "client_disconnected",
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_waiting_for_the_first_token_cancels_the_run(
    edge: Edge, http: aiohttp.ClientSession, stream: bool
) -> None:
    run = FakeRun([start()], hang=True)
    edge.service.plan = lambda spec: run
    request = asyncio.create_task(
        http.post(f"{edge.url}/v1/chat/completions", json=chat_body(stream=stream))
    )
    async with asyncio.timeout(WAIT):
        await run.hanging.wait()
    request.cancel()  # closes the connection before any byte of the response
    with pytest.raises(asyncio.CancelledError):
        await request
    async with asyncio.timeout(WAIT):
        await run.cancelled.wait()
    assert run.cancel_reasons == ["client disconnected"]
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status) == ("cancelled", 499)
    assert edge.metric("iop_edge_requests_in_flight", model=CHAT) == 0


async def test_disconnect_while_queued_leaves_the_queue(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.service.queue_forever = True
    request = asyncio.create_task(http.post(f"{edge.url}/v1/chat/completions", json=chat_body()))
    async with asyncio.timeout(WAIT):
        await edge.service.queued.wait()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    async with asyncio.timeout(WAIT):
        await edge.service.left_queue.wait()
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status, record.run_id[:4]) == ("cancelled", 499, "req-")


JSON = {"Content-Type": "application/json"}


async def test_key_concurrency_is_limited_and_released() -> None:
    run = FakeRun([start(), delta("Hel", role="assistant")], hang=True)
    async with serve({"sk-one": key("k1", max_concurrent=1)}) as edge:
        edge.service.plan = lambda spec: run
        auth = {"Authorization": "Bearer sk-one"}
        url = f"{edge.url}/v1/chat/completions"
        async with aiohttp.ClientSession(headers=auth) as http:
            first = await http.post(url, json=chat_body(stream=True))
            await first.content.readuntil(b"\n\n")
            async with http.post(url, json=chat_body()) as second:
                assert second.status == 429
                assert second.headers["Retry-After"] == "1"
                assert (await second.json())["error"]["code"] == "concurrency_limit_exceeded"
            # refused before its body is read: a key at its limit costs no parsing (not a 400)
            async with http.post(url, data=b"{not json", headers=JSON) as unread:
                assert unread.status == 429
            first.close()
            await edge.runlog.wait_for(3)  # the first's record comes after its slot is freed
            edge.service.plan = standard_run
            async with http.post(url, json=chat_body()) as third:
                assert third.status == 200


# ---------------------------------------------------------------- the other routes


async def test_models_respect_the_key_allow_list() -> None:
    keys = {"sk-chat": key("k1", CHAT, OTHER), "sk-all": key("k2")}
    async with serve(keys) as edge:
        async with edge.sdk("sk-chat") as client:
            listed = await client.models.list()
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve(EMBED)  # exists, but not for this key
        async with edge.sdk("sk-all") as client:
            everything = await client.models.list()
    assert [m.id for m in listed.data] == [CHAT, OTHER]
    assert [m.id for m in everything.data] == [CHAT, EMBED, OTHER]


async def test_iop_catalog_and_runs(edge: Edge, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{edge.url}/iop/v1/catalog/providers") as response:
        assert await response.json() == {"data": edge.catalog.provider_views()}
    async with http.get(f"{edge.url}/iop/v1/catalog/models") as response:
        assert await response.json() == {"data": edge.catalog.model_views()}
    for model in (CHAT, OTHER):
        async with http.post(
            f"{edge.url}/v1/chat/completions", json=chat_body(model=model)
        ) as response:
            assert response.status == 200
    await edge.runlog.wait_for(2)
    async with http.get(f"{edge.url}/iop/v1/runs") as response:
        runs = (await response.json())["data"]
    assert [r["model"] for r in runs] == [OTHER, CHAT]  # newest first
    assert runs[0]["outcome"] == "completed"
    assert runs[0]["operation"] == "chat_completions"
    async with http.get(f"{edge.url}/iop/v1/runs", params={"limit": "1"}) as response:
        assert len((await response.json())["data"]) == 1
    for bad in ("0", "1001", "ten"):
        async with http.get(f"{edge.url}/iop/v1/runs", params={"limit": bad}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "limit"


async def test_iop_endpoints_need_a_key_when_keys_are_configured() -> None:
    async with serve({"sk-a": key("k1", CHAT)}) as edge, aiohttp.ClientSession() as http:
        for path in ("/iop/v1/catalog/providers", "/iop/v1/catalog/models", "/iop/v1/runs"):
            async with http.get(edge.url + path) as response:
                assert response.status == 401
            headers = {"Authorization": "Bearer sk-a"}
            async with http.get(edge.url + path, headers=headers) as response:
                assert response.status == 200
        async with http.get(f"{edge.url}/healthz") as response:
            assert response.status == 200  # health never needs a key


async def test_runs_are_per_key_and_an_operator_sees_every_key_s_runs() -> None:
    keys = {"sk-a": key("ka"), "sk-b": key("kb"), "sk-ops": key("ops", CHAT, operator=True)}
    async with serve(keys) as edge, aiohttp.ClientSession() as http:
        for secret in ("sk-a", "sk-b", "sk-a"):
            async with edge.sdk(secret) as client:
                await client.chat.completions.create(
                    model=CHAT, messages=[{"role": "user", "content": "hi"}]
                )
        await edge.runlog.wait_for(3)
        seen = {}
        for secret in keys:
            headers = {"Authorization": f"Bearer {secret}"}
            async with http.get(f"{edge.url}/iop/v1/runs", headers=headers) as response:
                seen[secret] = [run["key_id"] for run in (await response.json())["data"]]
    assert seen == {"sk-a": ["ka", "ka"], "sk-b": ["kb"], "sk-ops": ["ka", "kb", "ka"]}


async def test_the_catalog_is_asked_for_the_caller_s_view() -> None:
    restricted, operator = key("k1", CHAT), key("ops", CHAT, operator=True)
    async with serve({"sk-a": restricted, "sk-ops": operator}) as edge:
        async with aiohttp.ClientSession() as http:
            for secret in ("sk-a", "sk-ops"):
                headers = {"Authorization": f"Bearer {secret}"}
                for path in ("/iop/v1/catalog/providers", "/iop/v1/catalog/models"):
                    async with http.get(edge.url + path, headers=headers) as response:
                        assert response.status == 200
    assert edge.catalog.asked_for == [restricted, restricted, operator, operator]


async def revoke_and_read(edge: Edge, response: aiohttp.ClientResponse, *keep: str) -> str:
    await edge.slots.apply_keys(frozenset(keep))
    return (await response.read()).decode()


async def test_revoking_a_key_ends_its_started_stream_with_an_sse_error_event() -> None:
    async with serve({"sk-a": key("ka"), "sk-b": key("kb")}) as edge:
        run = FakeRun([start(), delta("Hel", role="assistant")], hang=True)
        edge.service.plan = lambda spec: run
        await edge.slots.apply_keys(frozenset({"ka", "kb"}))
        auth = {"Authorization": "Bearer sk-a"}
        async with aiohttp.ClientSession(headers=auth) as http:
            url = f"{edge.url}/v1/chat/completions"
            async with http.post(url, json=chat_body(stream=True)) as response:
                assert response.status == 200
                await response.content.readuntil(b"\n\n")
                rest = await revoke_and_read(edge, response, "kb")
        *_, error, done = sse_data(rest)
        assert json.loads(error)["error"]["code"] == "invalid_api_key"
        assert "revoked" in json.loads(error)["error"]["message"]
        assert done == "[DONE]"
        assert run.cancel_reasons == ["API key revoked"]
        (record,) = await edge.runlog.wait_for(1)
    assert (record.key_id, record.status, record.error_code) == ("ka", 200, "invalid_api_key")
    assert edge.slots.held("ka") == 0


@pytest.mark.parametrize("where", ["queued", "waiting for the result", "before the first token"])
async def test_revoking_a_key_ends_its_waiting_requests_with_a_401(where: str) -> None:
    async with serve({"sk-a": key("ka", max_concurrent=2)}) as edge:
        run = FakeRun([start()], hang=True)
        edge.service.plan = lambda spec: run
        edge.service.queue_forever = where == "queued"
        auth = {"Authorization": "Bearer sk-a"}
        async with aiohttp.ClientSession(headers=auth) as http:
            body = chat_body(stream=where == "before the first token")
            request = asyncio.create_task(http.post(f"{edge.url}/v1/chat/completions", json=body))
            async with asyncio.timeout(WAIT):
                await (edge.service.queued if where == "queued" else run.hanging).wait()
            assert edge.slots.held("ka") == 1
            await edge.slots.apply_keys(frozenset())
            async with await request as response:
                assert response.status == 401
                error = (await response.json())["error"]
            # authenticated before the revocation reached the edge: refused at the start
            async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body()) as late:
                assert late.status == 401
        assert error["code"] == "invalid_api_key"
        assert "revoked" in error["message"]
        if where == "queued":
            assert edge.service.left_queue.is_set()
        else:
            assert run.cancel_reasons == ["API key revoked"]
        records = await edge.runlog.wait_for(2)
    assert [(r.key_id, r.status, r.error_code) for r in records] == [
        ("ka", 401, "invalid_api_key")
    ] * 2
    assert edge.slots.held("ka") == 0


async def test_a_revocation_leaves_other_keys_requests_alone() -> None:
    async with serve({"sk-a": key("ka"), "sk-b": key("kb")}) as edge:
        run = FakeRun([start(), delta("Hel", role="assistant")], hang=True)
        edge.service.plan = lambda spec: run
        auth = {"Authorization": "Bearer sk-b"}
        async with aiohttp.ClientSession(headers=auth) as http:
            url = f"{edge.url}/v1/chat/completions"
            async with http.post(url, json=chat_body(stream=True)) as response:
                await response.content.readuntil(b"\n\n")
                assert await edge.slots.apply_keys(frozenset({"kb"})) == 0
                assert not run.cancelled.is_set()
                assert edge.slots.held("kb") == 1


async def test_health_readiness_and_openapi(edge: Edge, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{edge.url}/healthz") as response:
        assert await response.json() == {"status": "ok"}
    async with http.get(f"{edge.url}/readyz") as response:
        assert response.status == 200
    edge.catalog.available = False
    async with http.get(f"{edge.url}/readyz") as response:
        assert response.status == 503
        assert (await response.json())["reason"]
    async with http.get(f"{edge.url}/openapi.json") as response:
        document = await response.json()
    assert document == load_openapi()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/models/{model_id}",
        "/iop/v1/catalog/providers",
        "/iop/v1/catalog/models",
        "/iop/v1/runs",
        "/iop/v1/usage",
        "/iop/v1/history",
        "/iop/v1/controls",
        "/iop/v1/controls/{change_id}/revert",
        "/iop/v1/qualifications",
        "/iop/v1/qualifications/{report_id}",
        "/iop/v1/catalog/qualifications",
        "/healthz",
        "/readyz",
        "/openapi.json",
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/compact",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
    }


async def test_unknown_routes_and_methods_are_openai_errors(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{edge.url}/v1/nothing-here", json={}) as response:
        assert response.status == 404
        error = (await response.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert "/v1/nothing-here" in error["message"]
    async with http.get(f"{edge.url}/v1/chat/completions") as response:
        assert response.status == 405
        assert "POST" in response.headers["Allow"]
        assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_an_unexpected_exception_is_a_500_and_still_recorded(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.service.error = RuntimeError("a bug in the dispatcher")
    async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body()) as response:
        assert response.status == 500
        error = (await response.json())["error"]
    assert error["type"] == "server_error"
    assert "a bug" not in error["message"]  # internals stay in the log
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status, record.error_code) == ("failed", 500, "internal_error")


async def test_an_edge_failure_mid_stream_ends_the_stream_with_an_error_event(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    run = FakeRun([start(), delta("Hel", role="assistant")], fail=RuntimeError("link bug"))
    edge.service.plan = lambda spec: run
    async with http.post(
        f"{edge.url}/v1/chat/completions", json=chat_body(stream=True)
    ) as response:
        assert response.status == 200
        payloads = sse_data(await response.text())  # one well-formed stream, no 2nd response
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Hel"
    assert json.loads(payloads[1])["error"]["code"] == "internal_error"
    assert payloads[2:] == ["[DONE]"]
    assert run.cancel_reasons == ["edge failed: RuntimeError"]
    (record,) = await edge.runlog.wait_for(1)
    assert (record.outcome, record.status, record.error_code) == ("failed", 200, "internal_error")


# ---------------------------------------------------------------- CORS (http.cors_origins)

APP_ORIGIN = "http://localhost:3000"


async def test_a_configured_origin_gets_its_preflight_and_cors_headers_on_streams() -> None:
    async with serve({"sk-chat": key("k1", CHAT)}, cors_origins=(APP_ORIGIN,)) as edge:
        async with aiohttp.ClientSession() as http:
            preflight = await http.options(
                f"{edge.url}/v1/chat/completions",
                headers={
                    "Origin": APP_ORIGIN,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )  # no key: a preflight carries none
            headers = {"Origin": APP_ORIGIN, "Authorization": "Bearer sk-chat"}
            async with http.post(
                f"{edge.url}/v1/chat/completions", json=chat_body(stream=True), headers=headers
            ) as streamed:
                await streamed.read()
            refused = await http.post(
                f"{edge.url}/v1/chat/completions", json=chat_body(), headers={"Origin": APP_ORIGIN}
            )
    assert preflight.status == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert streamed.status == 200
    assert streamed.headers["Content-Type"] == "text/event-stream"
    assert streamed.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert streamed.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
    assert streamed.headers["Vary"] == "Origin"
    # An error answer is readable by the app too (the 401 names the missing key).
    assert refused.status == 401
    assert refused.headers["Access-Control-Allow-Origin"] == APP_ORIGIN


async def test_an_origin_not_configured_gets_no_cors_headers() -> None:
    async with serve(cors_origins=(APP_ORIGIN,)) as edge:
        async with aiohttp.ClientSession() as http:
            other = {"Origin": "http://evil.example"}
            preflight = await http.options(
                f"{edge.url}/v1/chat/completions",
                headers={**other, "Access-Control-Request-Method": "POST"},
            )
            answer = await http.post(
                f"{edge.url}/v1/chat/completions", json=chat_body(), headers=other
            )
    assert preflight.status == 204
    assert "Access-Control-Allow-Origin" not in preflight.headers
    assert "Access-Control-Allow-Methods" not in preflight.headers
    assert answer.status == 200
    assert "Access-Control-Allow-Origin" not in answer.headers


async def test_without_origins_configured_cors_is_off(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    preflight = await http.options(
        f"{edge.url}/v1/chat/completions",
        headers={"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    answer = await http.post(
        f"{edge.url}/v1/chat/completions", json=chat_body(), headers={"Origin": APP_ORIGIN}
    )
    assert preflight.status == 405  # no route answers OPTIONS
    assert "Access-Control-Allow-Origin" not in answer.headers


async def test_any_origin_with_a_star() -> None:
    async with serve(cors_origins=("*",)) as edge:
        async with aiohttp.ClientSession() as http:
            answer = await http.get(f"{edge.url}/v1/models", headers={"Origin": "https://a.b"})
    assert answer.headers["Access-Control-Allow-Origin"] == "*"
    assert "Vary" not in answer.headers


# ---------------------------------------------------------------- Anthropic's Messages API


# ---------------------------------------------------------------- output lengths past the cap


OPENCODE_TITLE_REQUEST: dict[str, Any] = {
    # opencode 1.18's first request of a session (captured, text shortened): it asks
    # 32000 whatever the model, and a refusal failed every session.
    "model": CHAT,
    "max_tokens": 32000,
    "messages": [
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": "list the files here"},
    ],
    "stream": True,
    "stream_options": {"include_usage": True},
}


def capped(edge: Edge, cap: int) -> None:
    edge.catalog.entries[0] = dataclasses.replace(edge.catalog.entries[0], max_output_tokens=cap)


async def test_opencodes_request_past_the_cap_runs_clamped_and_says_so(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    capped(edge, 4096)
    async with http.post(f"{edge.url}/v1/chat/completions", json=OPENCODE_TITLE_REQUEST) as resp:
        assert resp.status == 200
        assert resp.headers["x-iop-max-tokens-clamped"] == "32000->4096"
        chunks = [json.loads(d) for d in sse_data(await resp.text())[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello"
    [spec] = edge.service.specs
    assert spec.body["max_tokens"] == 4096
    assert OPENCODE_TITLE_REQUEST["max_tokens"] == 32000  # the client's body is its own


async def test_every_api_clamps_by_the_one_rule_with_the_one_header(edge: Edge) -> None:
    capped(edge, 64)
    hello = [{"role": "user", "content": "hi"}]
    async with edge.sdk() as client:
        chat = await client.chat.completions.with_raw_response.create(
            model=CHAT, messages=hello, max_completion_tokens=2**31 - 1
        )
        text = await client.completions.with_raw_response.create(
            model=CHAT, prompt="hi", max_tokens=65
        )
        within = await client.chat.completions.with_raw_response.create(
            model=CHAT, messages=hello, max_tokens=64
        )
    async with anthropic_sdk(edge) as anthropic_client:
        message = await anthropic_client.messages.with_raw_response.create(
            model=CHAT, max_tokens=16000, messages=hello
        )
    assert chat.headers["x-iop-max-tokens-clamped"] == "2147483647->64"
    assert text.headers["x-iop-max-tokens-clamped"] == "65->64"
    assert message.headers["x-iop-max-tokens-clamped"] == "16000->64"
    assert "x-iop-max-tokens-clamped" not in within.headers
    specs = edge.service.specs
    assert [s.body.get("max_tokens", s.body.get("max_completion_tokens")) for s in specs] == [
        64,
        64,
        64,
        64,
    ]


async def test_a_request_asking_no_length_gets_the_cap_of_a_model_with_a_context_window(
    edge: Edge,
) -> None:
    """An engine left to its own default (llama.cpp's: until the context is full) would
    run far past the cap the fleet set; a model without a context window is left alone."""
    hello = [{"role": "user", "content": "hi"}]
    async with edge.sdk() as client:
        await client.chat.completions.create(model=CHAT, messages=hello)
        edge.catalog.entries[0] = dataclasses.replace(
            edge.catalog.entries[0], max_output_tokens=256, context_window=8192
        )
        raw = await client.chat.completions.with_raw_response.create(model=CHAT, messages=hello)
        await client.completions.create(model=CHAT, prompt="hi")
        await client.chat.completions.create(model=CHAT, messages=hello, max_tokens=5)
    unasked, capped_chat, capped_text, asked = edge.service.specs
    assert "max_tokens" not in unasked.body
    assert capped_chat.body["max_tokens"] == capped_text.body["max_tokens"] == 256
    assert "x-iop-max-tokens-clamped" not in raw.headers  # nothing the client asked changed
    assert asked.body["max_tokens"] == 5


@pytest.mark.parametrize("value", [2**31, 0, -1, "32000", 1.5, True])
async def test_output_lengths_that_are_not_integers_below_2_to_the_31_stay_a_400(
    edge: Edge, http: aiohttp.ClientSession, value: object
) -> None:
    for path, body in (
        ("/v1/chat/completions", chat_body(max_tokens=value)),
        ("/v1/completions", {"model": CHAT, "prompt": "hi", "max_tokens": value}),
    ):
        async with http.post(f"{edge.url}{path}", json=body) as resp:
            error = (await resp.json())["error"]
            assert (resp.status, error["param"]) == (400, "max_tokens"), error
            assert "x-iop-max-tokens-clamped" not in resp.headers
    assert edge.service.specs == []


def anthropic_sdk(edge: Edge, **auth: Any) -> anthropic.AsyncAnthropic:
    auth = auth or {"api_key": "sk-any"}
    return anthropic.AsyncAnthropic(base_url=edge.url, max_retries=0, **auth)


async def test_messages_run_as_chat_and_answer_as_messages(edge: Edge) -> None:
    async with anthropic_sdk(edge) as client:
        message = await client.messages.create(
            model=CHAT,
            max_tokens=5,
            system="sys",
            messages=[{"role": "user", "content": "hi"}],
        )
        async with client.messages.stream(
            model=CHAT, max_tokens=99_999, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            final = await stream.get_final_message()
    plain, streamed = edge.service.specs
    assert plain.operation is Operation.CHAT_COMPLETIONS
    assert plain.body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert plain.body["max_tokens"] == 5
    assert streamed.body["max_tokens"] == 32768  # lowered to the model's max_output_tokens
    assert (streamed.stream, streamed.body["stream_options"]) == (True, {"include_usage": True})
    assert message.id == "msg_run-1"
    assert message.model == CHAT  # the public id, never the served name
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello"  # type: ignore[union-attr]
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == (
        "end_turn",
        5,
        2,
    )
    assert final.content[0].text == "Hello"  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 2)
    records = await edge.runlog.wait_for(2)
    assert {(r.operation, r.outcome, r.status) for r in records} == {
        ("chat_completions", "completed", 200)
    }


async def test_count_tokens_runs_one_token_and_reads_the_prompt_usage(edge: Edge) -> None:
    """No provider of the model has a tokenizer to ask: a run of one token."""
    async with anthropic_sdk(edge) as client:
        counted = await client.messages.count_tokens(
            model=CHAT, messages=[{"role": "user", "content": "hi"}]
        )
    assert counted.input_tokens == 5
    [spec] = edge.service.specs
    assert (spec.operation, spec.stream, spec.body["max_tokens"]) == (
        Operation.CHAT_COMPLETIONS,
        False,
        1,
    )
    [record] = await edge.runlog.wait_for(1)
    assert record.operation == "count_tokens"


async def test_count_tokens_asks_the_tokenizer_where_a_provider_has_one(edge: Edge) -> None:
    edge.catalog.counts_tokens = True
    edge.service.plan = lambda spec: FakeRun(
        [start(), complete(usage=usage(prompt=42, completion=0))]
    )
    async with anthropic_sdk(edge) as client:
        counted = await client.messages.count_tokens(
            model=CHAT,
            system="sys",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "t", "input_schema": {"type": "object"}}],
        )
    assert counted.input_tokens == 42
    [spec] = edge.service.specs
    assert (spec.operation, spec.stream) == (Operation.COUNT_TOKENS, False)
    assert "max_tokens" not in spec.body
    assert [m["role"] for m in spec.body["messages"]] == ["system", "user"]
    assert spec.body["tools"][0]["function"]["name"] == "t"


async def test_messages_keys_by_x_api_key_or_bearer_with_anthropic_errors() -> None:
    keys = {"sk-a": key("a", CHAT)}
    hello: Any = [{"role": "user", "content": "hi"}]
    async with serve(keys) as edge:
        for auth in ({"api_key": "sk-a"}, {"auth_token": "sk-a", "api_key": None}):
            async with anthropic_sdk(edge, **auth) as client:
                await client.messages.create(model=CHAT, max_tokens=1, messages=hello)
        async with anthropic_sdk(edge, api_key="sk-wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as wrong:
                await client.messages.create(model=CHAT, max_tokens=1, messages=hello)
        async with anthropic_sdk(edge, api_key="sk-a") as client:
            with pytest.raises(anthropic.PermissionDeniedError) as denied:
                await client.messages.create(model=OTHER, max_tokens=1, messages=hello)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{edge.url}/v1/messages", json={}) as response:
                missing = (response.status, await response.json())
            async with http.post(
                f"{edge.url}/v1/chat/completions", json={}, headers={"x-api-key": "sk-a"}
            ) as response:
                assert response.status == 400  # the same key serves OpenAI's routes too
    assert wrong.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    assert denied.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    assert missing[0] == 401
    assert missing[1]["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (NoProviderAvailable("none"), 529, "overloaded_error"),
        (QueueTimeout("waited"), 529, "overloaded_error"),
        (QueueFull("full"), 429, "rate_limit_error"),
    ],
)
async def test_messages_dispatch_refusals_in_anthropics_shape(
    edge: Edge, http: aiohttp.ClientSession, error: EdgeError, status: int, kind: str
) -> None:
    edge.service.error = error
    body = {"model": CHAT, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{edge.url}/v1/messages", json=body) as response:
        assert response.status == status
        assert response.headers["X-Request-Id"]
        assert await response.json() == {
            "type": "error",
            "error": {"type": kind, "message": error.message},
        }


async def test_messages_errors_raised_before_the_handler_are_anthropics(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{edge.url}/v1/messages/nope", json={}) as response:
        assert response.status == 404
        assert (await response.json())["error"]["type"] == "not_found_error"
    async with http.get(f"{edge.url}/v1/messages") as response:
        assert response.status == 405
        assert "POST" in response.headers["Allow"]
        assert (await response.json())["type"] == "error"
    async with http.post(f"{edge.url}/v1/messages", data=b"{not json") as response:
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"
    body = {"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{edge.url}/v1/messages", json=body) as response:
        assert response.status == 404
        assert (await response.json())["error"]["type"] == "not_found_error"
    assert edge.service.specs == []


async def test_a_messages_body_over_the_limit_is_request_too_large() -> None:
    async with serve(max_body_bytes=1024) as edge, aiohttp.ClientSession() as http:
        body = {
            "model": CHAT,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "x" * 4096}],
        }
        async with http.post(f"{edge.url}/v1/messages", json=body) as response:
            assert response.status == 413
            assert (await response.json())["error"]["type"] == "request_too_large"


async def test_a_messages_run_failing_mid_stream_ends_with_an_error_event(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    edge.service.plan = lambda spec: FakeRun(
        [start(), delta("Hel", role="assistant"), run_error(pb.ERROR_CODE_PROVIDER_ERROR)]
    )
    body = {
        "model": CHAT,
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with http.post(f"{edge.url}/v1/messages", json=body) as response:
        assert response.status == 200
        text = await response.text()
    names = [line.removeprefix("event: ") for line in text.split("\n") if line.startswith("event:")]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    last = text.strip().split("\n")[-1].removeprefix("data: ")
    assert json.loads(last) == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


async def test_a_draining_edge_answers_messages_with_anthropics_529() -> None:
    gate = StopGate()
    async with serve(stop_gate=gate) as edge, aiohttp.ClientSession() as http:
        gate.close()
        async with http.post(f"{edge.url}/v1/messages", json={}) as response:
            assert response.status == 529
            assert response.headers["Connection"] == "close"
            assert (await response.json())["error"]["type"] == "overloaded_error"
        async with http.post(f"{edge.url}/v1/chat/completions", json={}) as response:
            assert response.status == 503  # OpenAI's routes keep OpenAI's status
            assert (await response.json())["error"]["code"] == "shutting_down"


# ---------------------------------------------------------------- what Anthropic's clients need

CLAUDE_CODE = (
    Path(__file__).resolve().parents[4] / "tests/e2e/data/claude_code_2.1.197_messages.json"
)


async def test_claude_codes_request_runs_with_its_headers_and_gets_a_request_id(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    captured = json.loads(CLAUDE_CODE.read_text("utf-8"))
    sent = {**captured["body"], "model": CHAT}
    headers = {**captured["headers"], "x-api-key": "sk-any"}
    async with http.post(f"{edge.url}/v1/messages?beta=true", json=sent, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["request-id"] == "req_run-1"
        assert "x-iop-dropped-tools" not in r.headers
        text = await r.text()
    assert text.startswith("event: message_start")
    assert text.rstrip().endswith('data: {"type":"message_stop"}')
    [spec] = edge.service.specs
    assert [m["role"] for m in spec.body["messages"]] == ["system", "user"]
    assert spec.body["reasoning_effort"] == "high"
    assert not {"metadata", "context_management", "thinking", "output_config"} & set(spec.body)


async def test_server_tools_are_dropped_and_named_in_a_header(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    tools = [
        {"type": "web_search_20250305", "name": "web_search"},
        {"name": "get_weather", "input_schema": {"type": "object"}},
        {"type": "code_execution_20250825", "name": "code_execution"},
        {"type": "bash_20250124", "name": "bash"},
    ]
    body = {
        "model": CHAT,
        "max_tokens": 3,
        "tools": tools,
        "messages": [{"role": "user", "content": "hi"}],
    }
    for stream in (False, True):
        async with http.post(f"{edge.url}/v1/messages", json={**body, "stream": stream}) as r:
            assert r.status == 200
            assert r.headers["x-iop-dropped-tools"] == "web_search_20250305,code_execution_20250825"
    for spec in edge.service.specs:
        assert [t["function"]["name"] for t in spec.body["tools"]] == ["get_weather", "bash"]


async def test_every_anthropic_answer_carries_a_request_id(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    hello = {"model": CHAT, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{edge.url}/v1/messages", json=hello) as r:
        assert (r.status, r.headers["request-id"]) == (200, "req_run-1")
    async with http.post(f"{edge.url}/v1/messages", json={**hello, "max_tokens": 0}) as r:
        assert r.status == 400
        assert r.headers["request-id"] == "req_" + r.headers["X-Request-Id"]
    async with http.post(f"{edge.url}/v1/messages/nope", json={}) as r:
        assert r.status == 404  # raised before any handler: a fresh id
        assert r.headers["request-id"].startswith("req_")
    async with http.post(f"{edge.url}/v1/chat/completions", json=chat_body()) as r:
        assert r.status == 200
        assert "request-id" not in r.headers  # OpenAI's answers are left as they are
    async with serve({"sk-a": key("a", CHAT)}) as keyed:
        async with http.post(f"{keyed.url}/v1/messages", json=hello) as r:
            assert r.status == 401
            assert r.headers["request-id"].startswith("req_")


async def test_head_and_get_of_the_root_answer_200(edge: Edge, http: aiohttp.ClientSession) -> None:
    """Claude Code's first request is ``HEAD /``."""
    async with http.head(f"{edge.url}/") as r:
        assert r.status == 200
    async with http.get(f"{edge.url}/") as r:
        assert (r.status, await r.json()) == (200, {"status": "ok"})


async def test_models_in_anthropics_shape_for_an_anthropic_client(
    edge: Edge, http: aiohttp.ClientSession
) -> None:
    async with anthropic_sdk(edge) as client:
        page = await client.models.list()
        one = await client.models.retrieve(OTHER)
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.models.retrieve("nope")
    assert [(m.id, m.display_name, m.type) for m in page.data] == [
        (CHAT, "Llama 3.1 8B", "model"),
        (EMBED, "Embed v1", "model"),
        (OTHER, "Qwen 2.5 7B", "model"),
    ]
    assert (page.has_more, page.first_id, page.last_id) == (False, CHAT, OTHER)
    assert (one.id, one.created_at.year) == (OTHER, 1970)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model 'nope' does not exist."},
    }
    assert missing.value.response.headers["request-id"].startswith("req_")
    async with http.get(f"{edge.url}/v1/models") as r:
        openai_shape = await r.json()
    assert openai_shape["object"] == "list"  # without anthropic-version: OpenAI's shape
    assert "request-id" not in r.headers
    async with serve({"sk-a": key("a", CHAT)}) as keyed:
        async with anthropic_sdk(keyed, api_key="sk-a") as client:
            page = await client.models.list()
    assert [m.id for m in page.data] == [CHAT]  # a key sees the models it may use
