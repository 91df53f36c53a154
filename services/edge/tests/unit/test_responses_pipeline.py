"""``POST /v1/responses`` through the real run pipeline (``create_api_app``), served on
127.0.0.1 and driven by the official openai SDK, over small fakes that say exactly what
the run did: a failure after the first byte, a failure before it, a run that completes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from iop_edge.domain.events import (
    Completed,
    Delta,
    ErrorCode,
    Failed,
    RunEvent,
    Started,
    ToolCallDelta,
    Usage,
)
from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry
from iop_edge.entrypoints.api_dialect import DROPPED_TOOLS_HEADER
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.http_api import create_api_app, load_openapi
from iop_edge.errors import EdgeError, from_failure
from iop_edge.ports import AttemptRecord, EdgeRunRecord, RunSpec, StoredResponse
from iop_edge.testing import MemoryResponseStore, one_at_a_time
from iop_proto import json_codec
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.testing import loopback_app

MODEL = "m"


class Run:
    """A run whose events are given, all arrived at once."""

    def __init__(self, events: list[RunEvent]) -> None:
        self.run_id = "run1"
        self.provider_id = "p1"
        self.node_id = "n1"
        self.target = "served"
        self.node_wait_ms = 0
        self._events = events
        self.cancelled: list[str] = []

    async def _iterate(self) -> AsyncIterator[RunEvent]:
        for event in self._events:
            yield event

    _reading: AsyncIterator[RunEvent] | None = None

    async def next_events(self) -> tuple[RunEvent, ...]:
        if self._reading is None:
            self._reading = self._iterate()
        return await one_at_a_time(self._reading)

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        self.cancelled.append(reason)

    async def open(self) -> None:
        """Dispatched at once: no queue."""

    @property
    def ended(self) -> bool:
        return bool(self.cancelled)

    def error(self, failed: Failed) -> EdgeError:
        return from_failure(failed)

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        return (AttemptRecord(self.run_id, self.provider_id, self.node_id, "completed"),)


@dataclass
class Service:
    """``RunService``: each run says ``events``; the specs it was asked for are kept."""

    events: list[RunEvent] = field(default_factory=list)
    specs: list[RunSpec] = field(default_factory=list)

    def admit(self, spec: RunSpec) -> Run:
        self.specs.append(spec)
        return Run(self.events)


class Catalog:
    def model(self, model_id: str) -> ModelEntry | None:
        return ModelEntry(MODEL, MODEL, {"p1": "served"}) if model_id == MODEL else None


class OpenKeys:
    configured = True  # a fleet config has arrived
    open = True

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return None


@dataclass
class RunLog:
    records: list[EdgeRunRecord] = field(default_factory=list)

    def record(self, record: EdgeRunRecord) -> None:
        self.records.append(record)

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        return self.records[-limit:]


Store = MemoryResponseStore


@dataclass
class Edge:
    sdk: AsyncOpenAI
    service: Service
    store: Store
    runlog: RunLog


@contextlib.asynccontextmanager
async def serve(store: Store | None = None) -> AsyncIterator[Edge]:
    service, runlog = Service(), RunLog()
    store = Store() if store is None else store
    app = create_api_app(
        service,
        Catalog(),  # type: ignore[arg-type]  # only model() is used on this path
        OpenKeys(),
        runlog,
        ApiMetrics.create(CollectorRegistry()),
        openapi=load_openapi(),
        responses=store,
    )
    async with loopback_app(app, cancel_handlers=True) as port:
        url = f"http://127.0.0.1:{port}/v1"
        async with AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as sdk:
            yield Edge(sdk, service, store, runlog)


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    async with serve() as served:
        yield served


async def test_a_failure_after_the_first_byte_ends_the_stream_with_response_failed(
    edge: Edge,
) -> None:
    edge.service.events = [
        Started("p1"),
        Delta(text="half an ans", role="assistant"),
        Failed(ErrorCode.PROVIDER_ERROR, "the provider fell over"),
    ]
    stream = await edge.sdk.responses.create(model=MODEL, input="x", stream=True)
    events: list[Any] = []

    async def read() -> None:
        async for event in stream:
            events.append(event)

    # The error event carries its ``error`` object (the Open Responses specification's
    # ErrorStreamingEvent, and what OpenAI sends), on which the SDK raises.
    with pytest.raises(openai.APIError, match="the provider fell over"):
        await read()
    assert "response.output_text.delta" in [event.type for event in events]
    (kept_row,) = edge.store.rows.values()
    kept = json_codec.loads(kept_row.response_json)
    assert kept["status"] == "failed"  # kept, as OpenAI keeps failed responses
    assert kept["error"]["code"] == "server_error"
    assert kept["output"][0]["content"][0]["text"] == "half an ans"
    assert kept["completed_at"] is None
    (record,) = edge.runlog.records
    assert (record.outcome, record.status) == ("failed", 200)


async def test_a_failure_before_the_first_byte_is_an_http_error(edge: Edge) -> None:
    edge.service.events = [Failed(ErrorCode.PROVIDER_ERROR, "refused")]
    with pytest.raises(openai.APIStatusError) as info:
        await edge.sdk.responses.create(model=MODEL, input="x", stream=True)
    assert info.value.status_code == 502
    assert info.value.code == "provider_error"
    with pytest.raises(openai.APIStatusError):
        await edge.sdk.responses.create(model=MODEL, input="x")
    assert edge.store.rows == {}  # nothing was answered, nothing is kept


async def test_the_run_is_a_chat_completion_and_the_answer_a_response(edge: Edge) -> None:
    edge.service.events = [
        Started("p1"),
        Delta(text="hello", role="assistant"),
        Completed("stop", Usage(2, 1, 3)),
    ]
    response = await edge.sdk.responses.create(model=MODEL, input="hi", instructions="sys")
    (spec,) = edge.service.specs
    assert spec.body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert response.id == "resp_run1"
    assert response.output_text == "hello"
    assert response.usage is not None
    assert response.usage.total_tokens == 3
    assert edge.runlog.records[0].run_id == "run1"


class DownStore(MemoryResponseStore):
    """The shared store unreachable: every keep raises what ``reachable`` raises."""

    async def keep(self, response: StoredResponse) -> None:
        raise StoreDown("storing a response: the PostgreSQL store is unreachable")


async def test_an_answer_the_store_cannot_keep_is_a_retryable_error_never_a_completion() -> None:
    async with serve(DownStore()) as edge:
        said = Delta(text="hel", role="assistant")
        edge.service.events = [Started("p1"), said, Completed("stop")]
        with pytest.raises(openai.APIStatusError) as info:
            await edge.sdk.responses.create(model=MODEL, input="hi")
        assert info.value.status_code == 503
        assert info.value.code == "storage_unavailable"

        # Streamed: the status line is out, so the stream ends with why, never saying it was
        # stored (before: response.completed held back, then an internal error).
        stream = await edge.sdk.responses.create(model=MODEL, input="hi", stream=True)
        events: list[Any] = []

        async def read() -> None:
            async for event in stream:
                events.append(event)

        with pytest.raises(openai.APIError, match="could not be stored"):
            await read()
        types = [event.type for event in events]
        assert "response.output_text.delta" in types
        assert "response.completed" not in types
        assert edge.store.rows == {}
        streamed = edge.runlog.records[-1]
        assert (streamed.outcome, streamed.status, streamed.error_code) == (
            "failed",
            200,
            "storage_unavailable",
        )

        # store: false needs no store: answered as usual.
        answer = await edge.sdk.responses.create(model=MODEL, input="hi", store=False)
        assert answer.output_text == "hel"


async def test_max_output_tokens_past_the_cap_is_clamped_and_a_bad_one_named(edge: Edge) -> None:
    edge.service.events = [Started("p1"), Delta(text="hi"), Completed("stop", Usage(2, 1, 3))]
    raw = await edge.sdk.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=99_999
    )
    assert raw.headers["x-iop-max-tokens-clamped"] == "99999->32768"  # the default cap
    (spec,) = edge.service.specs
    assert spec.body["max_tokens"] == 32768
    with pytest.raises(openai.BadRequestError) as info:
        await edge.sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2**31)
    assert info.value.param == "max_output_tokens"  # as the client called it
    assert "'max_output_tokens'" in info.value.message


async def test_a_prompt_past_the_context_names_the_input(edge: Edge) -> None:
    edge.service.events = [
        Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "HTTP 400: too long", 400, 0, 4096, 5000)
    ]
    with pytest.raises(openai.BadRequestError) as info:
        await edge.sdk.responses.create(model=MODEL, input="x", stream=True)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "input")
    assert info.value.message.endswith(
        "This model's maximum context length is 4096 tokens. However, your input resulted "
        "in 5000 tokens. Please reduce the length of the input."
    )


CODEX_REQUEST = Path(__file__).parents[1] / "data" / "codex-0.171-request.json"


async def post(edge: Edge, body: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{edge.sdk.base_url}responses", json=body) as reply:
            assert reply.status == 200, await reply.text()
            return dict(reply.headers), await reply.read()


def final_response(raw: bytes) -> dict[str, Any]:
    frames = [frame for frame in raw.split(b"\n\n") if frame]
    last = json_codec.loads(frames[-1].split(b"\ndata: ", 1)[1])
    assert last["type"] == "response.completed"
    response: dict[str, Any] = last["response"]
    return response


async def test_codex_s_request_is_answered_and_its_next_turn_carries_the_reasoning_back(
    edge: Edge,
) -> None:
    """Codex 0.171's first request as captured (its texts trimmed): namespace, function and
    web_search tools, store false, encrypted reasoning asked for."""
    body = json_codec.loads(CODEX_REQUEST.read_bytes())
    body["model"] = MODEL
    edge.service.events = [
        Started("p1"),
        Delta(reasoning_text="I should spawn one.", role="assistant"),
        Delta(
            tool_calls=(
                ToolCallDelta(
                    0,
                    "call_7",
                    function_name="multi_agent_v1__spawn_agent",
                    function_arguments='{"message": "list"}',
                ),
            )
        ),
        Completed("tool_calls", Usage(5, 3, 8)),
    ]
    headers, raw = await post(edge, body)
    assert headers[DROPPED_TOOLS_HEADER] == "web_search"
    offered = [tool["function"]["name"] for tool in edge.service.specs[0].body["tools"]]
    assert "multi_agent_v1__spawn_agent" in offered
    assert "web_search" not in offered
    response = final_response(raw)
    assert response["prompt_cache_key"] == body["prompt_cache_key"]
    assert response["store"] is False
    assert isinstance(response["completed_at"], int)
    reasoning, call = response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["encrypted_content"].startswith("iop1.")
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert edge.store.rows == {}  # store: false
    # The next turn, as Codex sends it: its items back (the reasoning only sealed), with
    # the tool's output.
    sent_back = {k: v for k, v in reasoning.items() if k not in ("content", "status")}
    body["input"] = [
        *body["input"],
        sent_back,
        call,
        {"type": "function_call_output", "call_id": "call_7", "output": "spawned"},
    ]
    edge.service.events = [
        Started("p1"),
        Delta(text="done", role="assistant"),
        Completed("stop", Usage(9, 1, 10)),
    ]
    headers, raw = await post(edge, body)
    assert final_response(raw)["output"][0]["content"][0]["text"] == "done"
    messages = edge.service.specs[1].body["messages"]
    assistant, tool = messages[-2:]
    assert assistant["reasoning_content"] == "I should spawn one."
    assert assistant["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert tool == {"role": "tool", "tool_call_id": "call_7", "content": "spawned"}


async def test_a_non_streamed_answer_names_the_dropped_tools_too(edge: Edge) -> None:
    edge.service.events = [
        Started("p1"),
        Delta(text="hi", role="assistant"),
        Completed("stop", Usage(1, 1, 2)),
    ]
    body = {
        "model": MODEL,
        "input": "x",
        "tools": [{"type": "file_search", "vector_store_ids": ["v"]}, {"type": "mcp"}],
    }
    headers, raw = await post(edge, body)
    assert headers[DROPPED_TOOLS_HEADER] == "file_search,mcp"
    response = json_codec.loads(raw)
    assert response["tools"] == []
    assert response["service_tier"] == "default"
    headers, _ = await post(edge, {"model": MODEL, "input": "x"})
    assert DROPPED_TOOLS_HEADER not in headers
