"""The OpenAI-compatible adapter against a small OpenAI-shaped server on 127.0.0.1.

The server records every request it gets and answers with whatever the test
scripts, down to raw SSE bytes written in awkward pieces, so parsing, error
mapping and cancellation are checked on a real socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop_node.adapters import openai_compat
from iop_node.adapters.openai_compat import OpenAICompatAdapter, normalise_endpoint
from iop_node.adapters.provider_http import ProviderHttp, ProviderResponse
from iop_node.adapters.sse import iter_sse_data
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Delta, ExecutionSpec, Operation, ToolCallDelta, Usage
from iop_node.errors import (
    AnswerTooLarge,
    ConfigError,
    ErrorCode,
    InvalidRequest,
    ProviderFailed,
    ProviderTimeout,
    ProviderUnavailable,
    RunCancelled,
)
from iop_node.ports import AdapterContext, LifecycleFlags
from iop_node.testing import RecordingSink, execute_as_node
from iop_proto import json_codec
from iop_proto.framing import DEFAULT_MAX_ANSWER_BYTES
from iop_proto.testing import refused_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CHAT_RESULT: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "served/model",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    "x_provider_field": {"kept": True},
}


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes = b""


@dataclass
class FakeProvider:
    """An OpenAI-shaped server; ``reply`` answers every POST, ``models`` the probe."""

    url: str = ""
    reply: Handler | None = None
    models: Handler | None = None
    requests: list[Received] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle_post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.requests.append(Received(request.path, dict(request.headers), body, raw))
        try:
            if self.reply is None:
                return web.json_response(CHAT_RESULT)
            return await self.reply(request)
        except (asyncio.CancelledError, ConnectionResetError):
            # handler_cancellation: the client went away while we were answering.
            self.disconnected.set()
            raise

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(Received(request.path, dict(request.headers), {}))
        if self.models is not None:
            return await self.models(request)
        return web.json_response({"object": "list", "data": [{"id": "a"}, {"id": "b/c"}]})


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    fake = FakeProvider()
    app = web.Application()
    app.router.add_post("/{tail:.*}", fake.handle_post)
    app.router.add_get("/v1/models", fake.handle_models)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    fake.url = f"http://{host}:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@dataclass
class Clients:
    """The node's HTTP clients as ``bootstrap`` lends them to adapters."""

    session: aiohttp.ClientSession
    engines: ProviderHttp


@pytest.fixture
async def http() -> AsyncIterator[Clients]:
    engines = ProviderHttp()
    try:
        async with aiohttp.ClientSession() as session:
            yield Clients(session, engines)
    finally:
        await engines.aclose()


async def post_empty_object(http: Clients, url: str) -> ProviderResponse:
    """POST ``{}`` with the engines' client, as the adapter posts a run."""
    headers = {"Content-Type": "application/json"}
    return await http.engines.request("POST", url, headers=headers, body=b"{}", connect_timeout_s=5)


def make_adapter(
    http: Clients,
    endpoint: str,
    *,
    provider_type: str = "vllm",
    environ: dict[str, str] | None = None,
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    **settings: Any,
) -> OpenAICompatAdapter:
    config = ProviderConfig(
        id="p1", type=provider_type, settings={"endpoint": endpoint, **settings}
    )
    context = AdapterContext(http.session, environ or {}, max_answer_bytes, engines=http.engines)
    adapter = openai_compat.factory(provider_type)(config, context)
    assert isinstance(adapter, OpenAICompatAdapter)
    return adapter


def make_spec(
    body: dict[str, Any],
    *,
    operation: Operation = Operation.CHAT_COMPLETIONS,
    stream: bool = False,
    seconds: float = 10.0,
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="r1",
        model="public-name",
        provider_id="p1",
        adapter="vllm",
        target="served/model",
        operation=operation,
        body_json=json_codec.dumps({"model": "served/model", **body}),
        stream=stream,
        include_usage=False,
        deadline=asyncio.get_running_loop().time() + seconds,
    )


def chunk(**delta: Any) -> bytes:
    finish = delta.pop("finish_reason", None)
    event = {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}
    ]}  # fmt: skip
    return b"data: " + json.dumps(event).encode() + b"\n\n"


USAGE_CHUNK = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'


def sse_reply(pieces: Sequence[bytes], *, pause: float = 0.0) -> Handler:
    """Answer with ``pieces`` written one by one (each flushed), as a provider streams."""

    async def reply(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            if pause:
                await asyncio.sleep(pause)
        await response.write_eof()
        return response

    return reply


# --- request shape ---------------------------------------------------------------------


async def test_non_stream_forwards_the_listed_fields_and_returns_the_body(
    provider: FakeProvider, http: Clients
) -> None:
    kept = {
        "messages": [{"role": "user", "content": "héllo"}],
        "seed": 7,
        "logit_bias": {"50256": -100},
        "response_format": {"type": "json_object"},
        "top_k": 20,  # vLLM's own (openai_fields.ENGINE_FIELDS)
        "prompt_logprobs": 2,
    }
    # not on vLLM's list: unknown, its scheduler's priority, an output length of another engine
    dropped = {"x_vendor_knob": [1, {"deep": None}], "priority": -100, "n_predict": 10**6}
    spec = make_spec({**kept, **dropped})
    completion = await make_adapter(http, provider.url).execute(spec, RecordingSink())

    (got,) = provider.requests
    assert got.path == "/v1/chat/completions"
    assert got.body == {"model": "served/model", **kept, "stream": False}
    assert completion.result == CHAT_RESULT  # provider fields kept
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage(5, 1, 6)
    assert "Authorization" not in got.headers


async def test_stream_asks_for_usage_and_keeps_other_stream_options(
    provider: FakeProvider, http: Clients
) -> None:
    provider.reply = sse_reply([chunk(role="assistant"), chunk(content="a"), b"data: [DONE]\n\n"])
    spec = make_spec(
        {"messages": [], "stream_options": {"continuous_usage_stats": True}}, stream=True
    )
    await make_adapter(http, provider.url).execute(spec, RecordingSink())

    sent = provider.requests[0].body
    assert sent["stream"] is True
    assert sent["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert spec.body["stream_options"] == {"continuous_usage_stats": True}  # not mutated


async def test_a_body_the_edge_prepared_is_posted_byte_for_byte_and_never_parsed(
    provider: FakeProvider, http: aiohttp.ClientSession
) -> None:
    """``body_prepared``: the edge applied the type's allow-list, the served name and the
    streaming switches; the node sends those bytes as they came (spacing, key order, a
    field the node would have dropped: all kept) and never parses them."""
    prepared = b'{"model":"served/model", "messages":[],"x_kept":1,"stream":false}'
    spec = dataclasses.replace(make_spec({}), body_json=prepared, body_prepared=True)
    completion = await make_adapter(http, provider.url).execute(spec, RecordingSink())
    (got,) = provider.requests
    assert got.raw == prepared
    assert spec.parsed is None  # the node never parsed the body
    assert completion.finish_reason == "stop"


async def test_an_older_edges_body_is_prepared_by_the_node_as_before(
    provider: FakeProvider, http: aiohttp.ClientSession
) -> None:
    """``body_prepared`` false (an edge of before it): the node parses, filters and sets
    the streaming switches itself, and leaves the model as the edge wrote it."""
    spec = make_spec({"messages": [], "x_vendor_knob": 1, "stream": True}, stream=True)
    provider.reply = sse_reply([chunk(content="a"), b"data: [DONE]\n\n"])
    await make_adapter(http, provider.url).execute(spec, RecordingSink())
    (got,) = provider.requests
    assert got.body == {
        "model": "served/model",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_non_stream_result_bytes_travel_as_the_provider_sent_them(
    provider: FakeProvider, http: Clients
) -> None:
    raw = json.dumps(CHAT_RESULT, indent=2, ensure_ascii=False).replace("hi", "héllo").encode()

    async def reply(request: web.Request) -> web.StreamResponse:
        return web.Response(body=raw, content_type="application/json")

    provider.reply = reply
    completion = await make_adapter(http, provider.url).execute(make_spec({}), RecordingSink())
    assert completion.result_json == raw  # not parsed and encoded again on the way out
    assert completion.result == json.loads(raw)


async def test_a_result_only_the_standard_parser_reads_is_forwarded_as_it_came(
    provider: FakeProvider, http: Clients
) -> None:
    # NaN is no JSON, but Python servers write it; the edge's codec reads it as json does.
    raw = json.dumps({**CHAT_RESULT, "x_score": float("nan")}).encode()
    assert b"NaN" in raw

    async def reply(request: web.Request) -> web.StreamResponse:
        return web.Response(body=raw, content_type="application/json")

    provider.reply = reply
    completion = await make_adapter(http, provider.url).execute(make_spec({}), RecordingSink())
    assert completion.result_json == raw
    assert completion.result is not None
    assert completion.result["choices"] == CHAT_RESULT["choices"]
    assert completion.usage == Usage(5, 1, 6)


async def test_a_result_that_is_no_json_fails_clearly(
    provider: FakeProvider, http: Clients
) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b'{"choices": [', content_type="application/json")

    provider.reply = reply
    with pytest.raises(ProviderFailed, match="not JSON"):
        await make_adapter(http, provider.url).execute(make_spec({}), RecordingSink())


async def test_values_the_fast_encoder_refuses_are_still_forwarded(
    provider: FakeProvider, http: Clients
) -> None:
    body = {"messages": [{"role": "user", "content": "cut \ud83d"}], "seed": 2**70}
    await make_adapter(http, provider.url).execute(make_spec(body), RecordingSink())
    sent = provider.requests[0].body
    assert sent["seed"] == 2**70
    assert sent["messages"] == body["messages"]


@pytest.mark.parametrize(
    ("endpoint", "base"),
    [
        ("http://h:8000", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("http://h:8000/api/v1", "http://h:8000/api"),
    ],
)
def test_endpoint_is_normalised_with_or_without_v1(endpoint: str, base: str) -> None:
    assert normalise_endpoint(endpoint) == base


async def test_endpoint_with_v1_reaches_the_same_paths(
    provider: FakeProvider, http: Clients
) -> None:
    await make_adapter(http, provider.url + "/v1/").execute(
        make_spec({"messages": []}), RecordingSink()
    )
    assert provider.requests[0].path == "/v1/chat/completions"


async def test_factory_builds_each_flavor(http: Clients) -> None:
    for kind in ("vllm", "sglang", "llamacpp", "openai_api"):
        adapter = make_adapter(http, "http://h:1", provider_type=kind)
        assert adapter.name == kind
        assert adapter.capabilities() == LifecycleFlags(list_models=True)
    lemonade = make_adapter(http, "http://h:1", provider_type="lemonade")
    assert lemonade.capabilities() == LifecycleFlags(True, True, True, True, True)
    with pytest.raises(ConfigError, match="ollama"):
        openai_compat.factory("ollama")


async def test_missing_endpoint_is_a_config_error(http: Clients) -> None:
    config = ProviderConfig(id="p1", type="vllm", settings={})
    with pytest.raises(ConfigError, match="endpoint"):
        OpenAICompatAdapter(
            config,
            AdapterContext(http.session, {}, engines=http.engines),
            flavor=openai_compat.FLAVORS["vllm"],
        )


async def test_api_key_env_becomes_a_bearer_header(provider: FakeProvider, http: Clients) -> None:
    adapter = make_adapter(http, provider.url, environ={"K": "sk-secret"}, api_key_env="K")
    await adapter.execute(make_spec({"messages": []}), RecordingSink())
    assert (await adapter.probe()).ok
    assert [r.headers["Authorization"] for r in provider.requests] == ["Bearer sk-secret"] * 2


async def test_missing_api_key_variable_is_reported_not_sent(
    provider: FakeProvider, http: Clients
) -> None:
    adapter = make_adapter(http, provider.url, environ={}, api_key_env="OPENAI_KEY")
    result = await adapter.probe()
    assert not result.ok
    assert "OPENAI_KEY" in result.detail
    with pytest.raises(ProviderUnavailable, match="OPENAI_KEY"):
        await adapter.execute(make_spec({"messages": []}), RecordingSink())
    assert provider.requests == []


async def test_embeddings(provider: FakeProvider, http: Clients) -> None:
    result = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
        "usage": {"prompt_tokens": 4, "total_tokens": 4},
    }

    async def reply(request: web.Request) -> web.StreamResponse:
        return web.json_response(result)

    provider.reply = reply
    spec = make_spec({"input": ["a", "b"], "dimensions": 2}, operation=Operation.EMBEDDINGS)
    completion = await make_adapter(http, provider.url).execute(spec, RecordingSink())

    got = provider.requests[0]
    assert got.path == "/v1/embeddings"
    assert got.body == {"model": "served/model", "input": ["a", "b"], "dimensions": 2}
    assert completion.result == result
    assert completion.finish_reason == ""
    assert completion.usage == Usage(4, 0, 4)


# --- streaming ---------------------------------------------------------------------------


async def test_sse_reader_handles_crlf_comments_multiline_and_split_writes(
    provider: FakeProvider, http: Clients
) -> None:
    body = (
        b": keep-alive comment\r\n\r\n"
        b"event: message\r\nid: 1\r\ndata: first\r\n\r\n"
        b"data: two\ndata:  lines\n\n"  # only one space after the colon is dropped
        b"retry: 10\n\n"  # an event without data is skipped
        b"data\n\n"  # a bare field name: empty data
        b"data: " + b"x" * 70_000 + b"\n\n"  # longer than aiohttp's default line buffer
        b"data: [DONE]\n\n"
        b"data: after-done\n\n"
    )
    # Cut everywhere awkward: inside "data:", between \r and \n, between the two \n.
    cuts = sorted(
        {
            3,
            body.index(b"\r\n") + 1,  # between \r and \n
            body.index(b"data: first") + 3,  # inside "data:"
            body.index(b"first\r\n") + 6,
            body.index(b"lines\n\n") + 6,  # between the two \n
            body.index(b"xxx") + 100,  # inside the long line
            body.index(b"[DONE]") + 2,
            len(body),
        }
    )
    pieces = [body[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]
    provider.reply = sse_reply(pieces, pause=0.001)

    async with await post_empty_object(http, provider.url + "/v1/chat/completions") as response:
        events = [data async for data in iter_sse_data(response)]
    assert events == [b"first", b"two\n lines", b"", b"x" * 70_000]


async def test_sse_reader_keeps_a_last_event_without_blank_line(
    provider: FakeProvider, http: Clients
) -> None:
    provider.reply = sse_reply([b"data: a\n\ndata: b\r\n"])
    async with await post_empty_object(http, provider.url + "/v1/chat/completions") as response:
        assert [data async for data in iter_sse_data(response)] == [b"a", b"b"]


async def test_runs_one_after_another_share_one_connection(
    provider: FakeProvider, http: Clients
) -> None:
    """A stream's reader stops at ``[DONE]``, before the body's last chunk: the
    connection still goes back to the pool, and the next run does not connect again."""
    streamed = sse_reply([chunk(content="hi"), chunk(finish_reason="stop"), b"data: [DONE]\n\n"])
    peers: list[object] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        if request.path.endswith("/models"):
            return web.json_response({"object": "list", "data": []})
        return await streamed(request)

    provider.reply = reply
    adapter = make_adapter(http, provider.url)
    for _ in range(3):
        completion = await adapter.execute(make_spec({}, stream=True), RecordingSink())
        assert completion.finish_reason == "stop"
        # The body's end comes after [DONE]; the next run starts once it is in.
        await wait_until_pooled(http)
    assert len(peers) == 3
    assert len(set(peers)) == 1, peers


async def wait_until_pooled(http: Clients, within: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while http.engines.idle_connections == 0:
        assert loop.time() - started < within, "the connection was not pooled"
        await asyncio.sleep(0.01)


async def test_multi_line_json_chunks_and_usage(provider: FakeProvider, http: Clients) -> None:
    provider.reply = sse_reply(
        [
            chunk(role="assistant", content=None),
            b'data: {"choices": [{"index": 0,\r\ndata:  "delta": {"content": "Hel"}}]}\r\n\r\n',
            b": ping\n\n",
            chunk(content="lo", reasoning_content="thinking"),
            chunk(finish_reason="length"),
            USAGE_CHUNK,
            b"data: [DONE]\n\n",
        ]
    )
    sink = RecordingSink()
    spec = make_spec({"messages": []}, stream=True)
    completion = await make_adapter(http, provider.url).execute(spec, sink)

    assert sink.deltas[0] == Delta(role="assistant")
    assert sink.text == "Hello"
    assert [d.reasoning_text for d in sink.deltas] == ["", "", "thinking", ""]
    assert sink.deltas[-1].finish_reason == "length"
    assert completion.finish_reason == "length"
    assert completion.usage == Usage(3, 2, 5)
    assert completion.result is None


async def test_tool_call_deltas(provider: FakeProvider, http: Clients) -> None:
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_w"}}
    provider.reply = sse_reply(
        [
            chunk(role="assistant", tool_calls=[first]),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}]),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
            chunk(finish_reason="tool_calls"),
            b"data: [DONE]\n\n",
        ]
    )
    sink = RecordingSink()
    completion = await make_adapter(http, provider.url).execute(
        make_spec({"messages": [], "tools": [{"type": "function"}]}, stream=True), sink
    )
    calls = [call for d in sink.deltas for call in d.tool_calls]
    assert calls == [
        ToolCallDelta(index=0, id="call_1", type="function", function_name="get_w"),
        ToolCallDelta(index=0, function_arguments='{"city":'),
        ToolCallDelta(index=0, function_arguments='"Oslo"}'),
    ]
    assert completion.finish_reason == "tool_calls"
    assert provider.requests[0].body["tools"] == [{"type": "function"}]


async def test_text_completion_stream(provider: FakeProvider, http: Clients) -> None:
    def text(value: str, finish: str | None = None) -> bytes:
        event = {"object": "text_completion", "choices": [
            {"index": 0, "text": value, "finish_reason": finish}
        ]}  # fmt: skip
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    provider.reply = sse_reply([text("Once"), text(" upon"), text("", "stop"), USAGE_CHUNK])
    sink = RecordingSink()
    spec = make_spec({"prompt": "x"}, operation=Operation.COMPLETIONS, stream=True)
    completion = await make_adapter(http, provider.url).execute(spec, sink)

    assert provider.requests[0].path == "/v1/completions"
    assert sink.text == "Once upon"
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage(3, 2, 5)


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, InvalidRequest),
        (404, InvalidRequest),
        (422, InvalidRequest),
        (401, ProviderFailed),
        (429, ProviderFailed),
        (500, ProviderFailed),
        (503, ProviderFailed),
    ],
)
async def test_http_errors_map_to_failures_with_provider_status(
    provider: FakeProvider, http: Clients, status: int, kind: type[Exception]
) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        error = {"error": {"message": f"nope {status}", "type": "x", "code": status}}
        return web.json_response(error, status=status)

    provider.reply = reply
    for stream in (False, True):
        with pytest.raises(kind, match=f"nope {status}") as caught:
            await make_adapter(http, provider.url).execute(
                make_spec({"messages": []}, stream=stream), RecordingSink()
            )
        assert isinstance(caught.value, ProviderFailed | InvalidRequest)
        assert caught.value.provider_status == status
        assert type(caught.value) is kind


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"object":"error","message":"vllm says no","code":400}', "vllm says no"),
        (b'{"detail":"fastapi says no"}', "fastapi says no"),
        (b"<html>" + b"." * 2000 + b"bad gateway</html>", "bad gateway</html>"),
    ],
)
async def test_error_message_from_other_shapes(
    provider: FakeProvider, http: Clients, payload: bytes, message: str
) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, status=502, content_type="text/plain")

    provider.reply = reply
    with pytest.raises(ProviderFailed, match=message) as caught:
        await make_adapter(http, provider.url).execute(make_spec({"messages": []}), RecordingSink())
    assert caught.value.provider_status == 502
    assert len(caught.value.message) < 600


async def test_error_object_mid_stream(provider: FakeProvider, http: Clients) -> None:
    provider.reply = sse_reply(
        [chunk(content="partial"), b'data: {"error": {"message": "kv cache full"}}\n\n']
    )
    sink = RecordingSink()
    with pytest.raises(ProviderFailed, match="kv cache full"):
        await make_adapter(http, provider.url).execute(
            make_spec({"messages": []}, stream=True), sink
        )
    assert sink.text == "partial"


async def test_a_chunk_only_the_standard_parser_reads_still_streams(
    provider: FakeProvider, http: Clients
) -> None:
    nan_chunk = (
        b'data: {"choices":[{"index":0,"delta":{"content":"b"},'
        b'"logprobs":{"content":[{"logprob":-Infinity}]},"finish_reason":null}]}\n\n'
    )
    provider.reply = sse_reply([chunk(content="a"), nan_chunk, b"data: [DONE]\n\n"])
    sink = RecordingSink()
    await make_adapter(http, provider.url).execute(make_spec({}, stream=True), sink)
    assert sink.text == "ab"


async def test_malformed_chunk_fails(provider: FakeProvider, http: Clients) -> None:
    provider.reply = sse_reply([b"data: {not json\n\n"])
    with pytest.raises(ProviderFailed, match="malformed"):
        await make_adapter(http, provider.url).execute(
            make_spec({"messages": []}, stream=True), RecordingSink()
        )


async def test_connection_refused_is_unavailable(http: Clients) -> None:
    with refused_port() as port:
        adapter = make_adapter(http, f"http://127.0.0.1:{port}")
        with pytest.raises(ProviderUnavailable):
            await adapter.execute(make_spec({"messages": []}), RecordingSink())
        result = await adapter.probe()
    assert not result.ok
    assert "127.0.0.1" in result.detail


async def test_deadline_becomes_provider_timeout(provider: FakeProvider, http: Clients) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()  # never answers; cancelled when the client leaves
        raise AssertionError("unreachable")

    provider.reply = reply
    adapter = make_adapter(http, provider.url)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProviderTimeout):
        await execute_as_node(adapter, make_spec({"messages": []}, seconds=0.3), RecordingSink())
    assert loop.time() - started < 2
    await asyncio.wait_for(provider.disconnected.wait(), 5)

    with pytest.raises(ProviderTimeout):  # already past: fails without waiting
        await execute_as_node(adapter, make_spec({"messages": []}, seconds=-1), RecordingSink())


async def test_cancel_mid_stream_disconnects_from_the_provider(
    provider: FakeProvider, http: Clients
) -> None:
    provider.reply = sse_reply([chunk(content="t")] * 500, pause=0.02)
    sink = RecordingSink()
    run = asyncio.create_task(
        make_adapter(http, provider.url).execute(make_spec({"messages": []}, stream=True), sink)
    )
    await asyncio.wait_for(sink.first.wait(), 5)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await asyncio.wait_for(provider.disconnected.wait(), 5)
    assert len(sink.deltas) < 500


async def test_sink_gone_stops_the_run_and_disconnects(
    provider: FakeProvider, http: Clients
) -> None:
    provider.reply = sse_reply([chunk(content="t")] * 500, pause=0.02)
    with pytest.raises(RunCancelled):
        await make_adapter(http, provider.url).execute(
            make_spec({"messages": []}, stream=True), RecordingSink(fail_after=2)
        )
    await asyncio.wait_for(provider.disconnected.wait(), 5)


# --- probe -------------------------------------------------------------------------------


async def test_probe_lists_models(provider: FakeProvider, http: Clients) -> None:
    result = await make_adapter(http, provider.url + "/v1").probe()
    assert result.ok
    assert result.models == ("a", "b/c")
    assert [r.path for r in provider.requests] == ["/v1/models"]  # never a completion


async def test_probe_error_status_is_not_ok(provider: FakeProvider, http: Clients) -> None:
    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "Loading model"}}, status=503)

    provider.models = models
    result = await make_adapter(http, provider.url).probe()
    assert not result.ok
    assert "503" in result.detail
    assert "Loading model" in result.detail


async def test_probe_of_a_down_server_is_not_ok(http: Clients) -> None:
    with refused_port() as port:
        result = await make_adapter(http, f"http://127.0.0.1:{port}").probe()
    assert not result.ok
    assert result.detail


# --- count_tokens ----------------------------------------------------------------------


async def test_vllm_counts_with_tokenize_and_the_messages(
    provider: FakeProvider, http: Clients
) -> None:
    """vLLM's ``/tokenize`` applies the chat template to the messages and tools itself."""

    async def counted(request: web.Request) -> web.StreamResponse:
        return web.json_response({"count": 17, "max_model_len": 4096, "tokens": [1] * 17})

    provider.reply = counted
    adapter = make_adapter(http, provider.url)
    tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": "auto",
        "reasoning_effort": "high",
    }
    completion = await adapter.count_tokens(make_spec(body, operation=Operation.COUNT_TOKENS))
    assert completion.usage == Usage(17, 0, 17)
    [received] = provider.requests
    assert received.path == "/tokenize"
    assert received.body == {
        "model": "served/model",
        "messages": body["messages"],
        "tools": [tool],
        "add_generation_prompt": True,
    }


@pytest.mark.parametrize(("status", "expected"), [(404, 501), (501, 501), (400, 400)])
async def test_a_tokenize_error_keeps_its_meaning(
    provider: FakeProvider, http: Clients, status: int, expected: int
) -> None:
    """No such endpoint (an older engine): the operation is not offered there (501)."""

    async def refused(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "no"}, status=status)

    provider.reply = refused
    adapter = make_adapter(http, provider.url)
    with pytest.raises(InvalidRequest) as info:
        await adapter.count_tokens(make_spec({"messages": []}, operation=Operation.COUNT_TOKENS))
    assert info.value.provider_status == expected


# --- answers past the limit ------------------------------------------------------------


def chunked_reply(pieces: int, size: int) -> Handler:
    """A JSON answer without a Content-Length, written in ``pieces`` of ``size`` bytes."""

    async def reply(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"choices":[{"index":0,"message":{"content":"')
        for _ in range(pieces):
            await response.write(b"x" * size)
        await response.write(b'"},"finish_reason":"stop"}]}')
        await response.write_eof()
        return response

    return reply


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "chunked"])
async def test_an_answer_past_the_limit_is_refused_unread(
    provider: FakeProvider, http: Clients, announced: bool
) -> None:
    limit = 64 * 1024
    if announced:
        big = {**CHAT_RESULT, "padding": "x" * (2 * limit)}
        provider.reply = lambda request: _json(big)
    else:
        provider.reply = chunked_reply(pieces=32, size=8 * 1024)  # 256 KiB, as it comes
    adapter = make_adapter(http, provider.url, max_answer_bytes=limit)
    with pytest.raises(AnswerTooLarge) as caught:
        await adapter.execute(make_spec({"messages": []}), RecordingSink())
    assert caught.value.code == ErrorCode.INVALID_REQUEST  # the request's failure
    assert str(limit) in caught.value.message
    provider.reply = None  # the same adapter, an answer within the limit
    completion = await adapter.execute(make_spec({"messages": []}), RecordingSink())
    assert completion.result == CHAT_RESULT


async def test_a_streamed_event_past_the_limit_is_refused(
    provider: FakeProvider, http: Clients
) -> None:
    provider.reply = sse_reply([chunk(content="a"), chunk(content="x" * 100_000)])
    adapter = make_adapter(http, provider.url, max_answer_bytes=64 * 1024)
    sink = RecordingSink()
    with pytest.raises(AnswerTooLarge):
        await adapter.execute(make_spec({"messages": []}, stream=True), sink)
    assert [d.text for d in sink.deltas] == ["a"]  # what came before it went on


async def _json(value: Any) -> web.Response:
    return web.json_response(value)


async def test_a_probe_answer_past_the_limit_is_not_ok(
    provider: FakeProvider, http: Clients
) -> None:
    models = {"object": "list", "data": [{"id": "m" * 100}] * 1000}  # ~100 KB
    provider.models = lambda request: _json(models)
    result = await make_adapter(http, provider.url, max_answer_bytes=64 * 1024).probe()
    assert not result.ok
    assert "answer is too large" in result.detail
