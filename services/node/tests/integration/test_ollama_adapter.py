"""The Ollama adapter against a server speaking Ollama's documented API, and the real image.

Ollama itself cannot run on this machine (no binary outside Docker), so ``FakeOllama``
implements the documented endpoints on 127.0.0.1 with NDJSON streaming: deterministic
answers (the words of ``SENTENCE``, cut at ``num_predict``), tool calls, the error
shapes Ollama sends, and it records every request and notices client disconnects.
It lives here, not in a support module, because tests cannot import siblings under
pytest's importlib mode. The last test runs the same calls against ``ollama/ollama``
by testcontainers wherever a Docker engine answers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import json
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop_node.adapters.ollama import OllamaAdapter
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, ExecutionSpec, Operation
from iop_node.errors import (
    AnswerTooLarge,
    InvalidRequest,
    ProviderFailed,
    ProviderTimeout,
    ProviderUnavailable,
)
from iop_node.ports import AdapterContext
from iop_node.testing import RecordingSink, execute_as_node
from iop_proto import json_codec
from iop_proto.testing import refused_port

SENTENCE = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog")
SLOW = "slow:1b"  # streams a word every 10 ms until the client goes away
BROKEN = "broken:1b"  # answers 500, like a crashed runner
FLAKY = "flaky:1b"  # sends two words, then an error object mid-stream
CUT = "cut:1b"  # sends two words, then drops the connection, like a crashed server
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


class FakeOllama:
    """Ollama's documented API on an ephemeral port of 127.0.0.1."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.installed = {"tiny:1b", "embed:1b", SLOW, BROKEN, FLAKY, CUT}
        self.loaded: set[str] = set()
        self.disconnected = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/api/tags", self._tags)
        app.router.add_get("/api/ps", self._ps)
        app.router.add_post("/api/chat", self._chat)
        app.router.add_post("/api/generate", self._generate)
        app.router.add_post("/api/embed", self._embed)
        app.router.add_post("/api/pull", self._pull)
        app.router.add_delete("/api/delete", self._delete)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def last(self, path: str) -> dict[str, Any]:
        return next(body for _, p, body in reversed(self.requests) if p == path)

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        self.requests.append((request.method, request.path, body))
        model = body.get("model")
        if model is not None and request.path != "/api/pull" and model not in self.installed:
            return web.json_response({"error": f"model '{model}' not found"}, status=404)
        if model == BROKEN:
            return web.json_response({"error": "llama runner process has terminated"}, status=500)
        response: web.StreamResponse = await handler(request)
        return response

    async def _tags(self, request: web.Request) -> web.Response:
        models = [{"name": n, "model": n, "size": 1, "details": {}} for n in sorted(self.installed)]
        return web.json_response({"models": models})

    async def _ps(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [{"name": n, "model": n} for n in sorted(self.loaded)]})

    async def _pull(self, request: web.Request) -> web.Response:
        self.installed.add((await request.json())["model"])
        return web.json_response({"status": "success"})

    async def _delete(self, request: web.Request) -> web.Response:
        self.installed.discard((await request.json())["model"])
        return web.Response()  # Ollama answers a delete with an empty 200

    async def _embed(self, request: web.Request) -> web.Response:
        body = await request.json()
        items = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vectors = [[float(len(text)), float(i), 0.5] for i, text in enumerate(items)]
        words = sum(len(text.split()) for text in items)
        return web.json_response(
            {"model": body["model"], "embeddings": vectors, "prompt_eval_count": words}
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("prompt"):  # no prompt: load, or with keep_alive 0 unload
            unload = body.get("keep_alive") == 0
            (self.loaded.discard if unload else self.loaded.add)(body["model"])
            reason = "unload" if unload else "load"
            return web.json_response(
                {"model": body["model"], "response": "", "done": True, "done_reason": reason}
            )
        return await self._answer(request, body, "response", len(body["prompt"].split()), [])

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages = body["messages"]
        words = sum(len(m.get("content", "").split()) for m in messages)
        calls = []
        if body.get("tools") and "weather" in messages[-1].get("content", ""):
            name = body["tools"][0]["function"]["name"]
            calls = [{"function": {"name": name, "arguments": {"city": "Paris"}}}]
        return await self._answer(request, body, "message", words, calls)

    async def _answer(
        self, request: web.Request, body: dict[str, Any], field: str, words: int, calls: list[Any]
    ) -> web.StreamResponse:
        limit = body.get("options", {}).get("num_predict", -1)  # -1: no limit, as in Ollama
        cut = not calls and 0 <= limit < len(SENTENCE)
        produced = [] if calls else list(SENTENCE[:limit] if cut else SENTENCE)
        pieces = [w if i == 0 else f" {w}" for i, w in enumerate(produced)]
        final = {
            "model": body["model"],
            "done": True,
            "done_reason": "length" if cut else "stop",
            "prompt_eval_count": words,
            "eval_count": len(produced) or len(calls),
        }

        def piece(text: str, tool_calls: list[Any] | None = None) -> dict[str, Any]:
            if field == "response":
                return {"model": body["model"], "response": text, "done": False}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"model": body["model"], "message": message, "done": False}

        if not body.get("stream", True):
            return web.json_response({**piece("".join(pieces), calls), **final})
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            if body["model"] == SLOW:
                while True:
                    await response.write(json.dumps(piece("word ")).encode() + b"\n")
                    await asyncio.sleep(0.01)
            lines = [piece(p) for p in pieces] + ([piece("", calls)] if calls else [])
            if body["model"] in (FLAKY, CUT):
                lines = [*lines[:2], {"error": "an error was encountered while running the model"}]
            else:
                lines.append({**piece(""), **final})
            for line in lines:
                if body["model"] == CUT and "error" in line:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await response.write(json.dumps(line).encode() + b"\n")
        except ConnectionResetError:
            self.disconnected.set()  # what the cancel and deadline tests wait for
            return response
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        await response.write_eof()
        return response


@pytest.fixture
async def fake() -> AsyncIterator[FakeOllama]:
    server = FakeOllama()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def make_adapter(http: aiohttp.ClientSession, endpoint: str) -> OllamaAdapter:
    config = ProviderConfig(id="ollama-1", type="ollama", settings={"endpoint": endpoint})
    return OllamaAdapter(config, AdapterContext(http=http, environ={}))


@pytest.fixture
def adapter(fake: FakeOllama, http: aiohttp.ClientSession) -> OllamaAdapter:
    return make_adapter(http, fake.url)


def spec(
    body: dict[str, Any],
    *,
    operation: Operation = Operation.CHAT_COMPLETIONS,
    stream: bool = False,
    seconds: float = 10.0,
) -> ExecutionSpec:
    model = body.setdefault("model", "tiny:1b")
    return ExecutionSpec(
        run_id="run-0123456789abcdef",
        model="tiny",
        provider_id="ollama-1",
        adapter="ollama",
        target=model,
        operation=operation,
        body_json=json_codec.dumps(body),
        stream=stream,
        include_usage=True,
        deadline=asyncio.get_running_loop().time() + seconds,
    )


def chat(content: str | list[dict[str, Any]] = "hello there", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


async def test_stream_chat_sends_deltas_then_usage_and_stop(adapter: OllamaAdapter) -> None:
    sink = RecordingSink()
    completion = await adapter.execute(spec(chat(), stream=True), sink)
    assert sink.text == " ".join(SENTENCE)
    assert [d.role for d in sink.deltas] == ["assistant"] + [""] * (len(SENTENCE) - 1)
    assert completion.finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 9)
    assert completion.result is None


async def test_stream_chat_stops_at_num_predict_with_length(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    sink = RecordingSink()
    completion = await adapter.execute(spec(chat(max_tokens=3), stream=True), sink)
    assert sink.text == "the quick brown"
    assert fake.last("/api/chat")["options"] == {"num_predict": 3}
    assert completion.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 3


async def test_non_stream_chat_is_an_openai_chat_completion(adapter: OllamaAdapter) -> None:
    completion = await adapter.execute(spec(chat(max_completion_tokens=4)), RecordingSink())
    result = completion.result
    assert result is not None
    assert result["id"] == "chatcmpl-run-0123456789abcdef"
    assert (result["object"], result["model"]) == ("chat.completion", "tiny:1b")
    assert isinstance(result["created"], int)
    choice = result["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "the quick brown fox"}
    assert choice["finish_reason"] == completion.finish_reason == "length"
    assert result["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


async def test_openai_parameters_become_ollama_options_and_format(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    body = chat(
        max_tokens=50,
        max_completion_tokens=5,
        temperature=0.2,
        top_p=0.9,
        seed=7,
        stop="dog",
        presence_penalty=0.1,
        frequency_penalty=0.3,
        response_format={"type": "json_object"},
        keep_alive="10m",
    )
    await adapter.execute(spec(body), RecordingSink())
    sent = fake.last("/api/chat")
    assert sent["options"] == {
        "num_predict": 5,
        "temperature": 0.2,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["dog"],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.3,
    }
    assert (sent["format"], sent["keep_alive"], sent["stream"]) == ("json", "10m", False)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    )
    await adapter.execute(spec(body), RecordingSink())
    assert fake.last("/api/chat")["format"] == schema


async def test_messages_are_converted_to_ollama_shape(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    png = base64.b64encode(b"\x89PNG fake").decode()
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "text", "text": "this?"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "look", "arguments": '{"x": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
    ]
    await adapter.execute(spec({"messages": messages}), RecordingSink())
    assert fake.last("/api/chat")["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is\nthis?", "images": [png]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "look", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "a cat", "tool_name": "look"},
    ]
    remote = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    requests = len(fake.requests)
    with pytest.raises(InvalidRequest, match="base64"):
        await adapter.execute(spec(chat(remote)), RecordingSink())
    assert len(fake.requests) == requests  # refused before any call


async def test_stream_tool_calls_become_tool_call_deltas(adapter: OllamaAdapter) -> None:
    sink = RecordingSink()
    body = chat("what is the weather in Paris?", tools=[WEATHER_TOOL])
    completion = await adapter.execute(spec(body, stream=True), sink)
    calls = [call for d in sink.deltas for call in d.tool_calls]
    assert len(calls) == 1
    call = calls[0]
    assert (call.index, call.id, call.type) == (0, "call_456789abcdef_0", "function")
    assert (call.function_name, json.loads(call.function_arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert sink.deltas[0].role == "assistant"
    assert completion.finish_reason == "tool_calls"


async def test_non_stream_tool_calls_are_in_the_message(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    body = chat("weather please", tools=[WEATHER_TOOL])
    completion = await adapter.execute(spec(body), RecordingSink())
    assert fake.last("/api/chat")["tools"] == [WEATHER_TOOL]
    assert completion.result is not None
    choice = completion.result["choices"][0]
    assert choice["finish_reason"] == completion.finish_reason == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_456789abcdef_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]


async def test_completions_use_api_generate(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    body = {"prompt": "once upon a time", "max_tokens": 2, "suffix": "end"}
    sink = RecordingSink()
    completion = await adapter.execute(
        spec(body, operation=Operation.COMPLETIONS, stream=True), sink
    )
    assert sink.text == "the quick"
    assert all(d.role == "" for d in sink.deltas)
    assert completion.finish_reason == "length"
    sent = fake.last("/api/generate")
    assert (sent["prompt"], sent["suffix"], sent["options"]) == (
        "once upon a time",
        "end",
        {"num_predict": 2},
    )

    body = {"prompt": ["once upon a time"]}
    result = (await adapter.execute(spec(body, operation=Operation.COMPLETIONS), sink)).result
    assert result is not None
    assert (result["id"], result["object"]) == ("cmpl-run-0123456789abcdef", "text_completion")
    assert result["choices"][0]["text"] == " ".join(SENTENCE)
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}


async def test_embeddings_use_api_embed(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    body = {"model": "embed:1b", "input": ["a b", "cde"]}
    completion = await adapter.execute(spec(body, operation=Operation.EMBEDDINGS), RecordingSink())
    assert fake.last("/api/embed") == {"model": "embed:1b", "input": ["a b", "cde"]}
    assert completion.result == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [3.0, 0.0, 0.5]},
            {"object": "embedding", "index": 1, "embedding": [3.0, 1.0, 0.5]},
        ],
        "model": "embed:1b",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    body = {"model": "embed:1b", "input": "hi", "encoding_format": "base64"}
    result = (
        await adapter.execute(spec(body, operation=Operation.EMBEDDINGS), RecordingSink())
    ).result
    assert result is not None
    packed = base64.b64decode(result["data"][0]["embedding"])
    assert struct.unpack("<3f", packed) == (2.0, 0.0, 0.5)


async def test_unknown_model_is_an_invalid_request(adapter: OllamaAdapter) -> None:
    with pytest.raises(InvalidRequest, match="model 'nope:1b' not found") as caught:
        await adapter.execute(spec(chat(model="nope:1b"), stream=True), RecordingSink())
    assert caught.value.provider_status == 404


async def test_server_error_is_provider_failed_with_its_status(adapter: OllamaAdapter) -> None:
    with pytest.raises(ProviderFailed, match="runner process has terminated") as caught:
        await adapter.execute(spec(chat(model=BROKEN)), RecordingSink())
    assert caught.value.provider_status == 500


async def test_error_object_mid_stream_is_provider_failed(adapter: OllamaAdapter) -> None:
    sink = RecordingSink()
    with pytest.raises(ProviderFailed, match="error was encountered"):
        await adapter.execute(spec(chat(model=FLAKY), stream=True), sink)
    assert sink.text == "the quick"


async def test_connection_lost_mid_stream_is_provider_failed(adapter: OllamaAdapter) -> None:
    sink = RecordingSink()
    with pytest.raises(ProviderFailed, match="broke off"):
        await adapter.execute(spec(chat(model=CUT), stream=True), sink)
    assert sink.text == "the quick"


async def test_connection_refused_is_provider_unavailable(http: aiohttp.ClientSession) -> None:
    with refused_port() as port:
        adapter = make_adapter(http, f"http://127.0.0.1:{port}")
        with pytest.raises(ProviderUnavailable, match="cannot reach ollama"):
            await adapter.execute(spec(chat(), stream=True), RecordingSink())


async def test_deadline_is_provider_timeout(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    sink = RecordingSink()
    with pytest.raises(ProviderTimeout):
        await execute_as_node(adapter, spec(chat(model=SLOW), stream=True, seconds=0.2), sink)
    assert sink.deltas
    async with asyncio.timeout(5):
        await fake.disconnected.wait()


async def test_cancel_mid_stream_closes_the_connection(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    sink = RecordingSink()
    run = asyncio.create_task(adapter.execute(spec(chat(model=SLOW), stream=True), sink))
    await sink.first.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    async with asyncio.timeout(5):
        await fake.disconnected.wait()


async def test_probe_lists_models_and_never_runs_one(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    result = await adapter.probe()
    assert result.ok
    assert set(result.models) == fake.installed
    # the installed models, then the loaded ones (warm-aware scheduling): lists only
    assert [(m, p) for m, p, _ in fake.requests] == [("GET", "/api/tags"), ("GET", "/api/ps")]


async def test_probe_of_an_unreachable_server_is_not_ok(http: aiohttp.ClientSession) -> None:
    with refused_port() as port:
        result = await make_adapter(http, f"http://127.0.0.1:{port}").probe()
    assert not result.ok
    assert "cannot reach ollama" in result.detail


async def test_lifecycle_calls_hit_ollamas_endpoints(
    adapter: OllamaAdapter, fake: FakeOllama
) -> None:
    flags = adapter.capabilities()
    assert all(
        (
            flags.list_models,
            flags.load_model,
            flags.unload_model,
            flags.pull_model,
            flags.delete_model,
        )
    )
    assert await adapter.pull_model("new:1b") == {"status": "success"}
    assert "new:1b" in {m["name"] for m in await adapter.list_models()}
    await adapter.load_model("new:1b")
    assert [m["name"] for m in await adapter.running_models()] == ["new:1b"]
    await adapter.unload_model("new:1b")
    assert await adapter.running_models() == []
    await adapter.delete_model("new:1b")
    with pytest.raises(InvalidRequest) as caught:
        await adapter.delete_model("new:1b")
    assert caught.value.provider_status == 404
    await adapter.aclose()
    assert fake.requests == [
        ("POST", "/api/pull", {"model": "new:1b", "stream": False}),
        ("GET", "/api/tags", {}),
        ("POST", "/api/generate", {"model": "new:1b", "keep_alive": "5m", "stream": False}),
        ("GET", "/api/ps", {}),
        ("POST", "/api/generate", {"model": "new:1b", "keep_alive": 0, "stream": False}),
        ("GET", "/api/ps", {}),
        ("DELETE", "/api/delete", {"model": "new:1b"}),
        ("DELETE", "/api/delete", {"model": "new:1b"}),
    ]


# ---------------------------------------------------------------- the real image

REAL_IMAGE = "ollama/ollama:latest"
REAL_CHAT_MODEL = "smollm2:135m"  # the model the compose stack serves; 135M runs on a CPU
REAL_EMBED_MODEL = "all-minilm:22m"


def docker_engine_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None or importlib.util.find_spec("testcontainers") is None:
        return False
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        return subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode == 0
    return False


@pytest.fixture(scope="module")
def real_ollama() -> Iterator[str]:
    if not docker_engine_answers():
        pytest.skip("no Docker engine on this machine: the real Ollama image cannot run here")
    from testcontainers.community.ollama import OllamaContainer

    with OllamaContainer(image=REAL_IMAGE) as container:
        yield str(container.get_endpoint())


@pytest.mark.slow
@pytest.mark.timeout(900)  # two model downloads
async def test_against_the_real_ollama_image(real_ollama: str, http: aiohttp.ClientSession) -> None:
    adapter = make_adapter(http, real_ollama)
    assert (await adapter.probe()).ok
    for model in (REAL_CHAT_MODEL, REAL_EMBED_MODEL):
        assert (await adapter.pull_model(model))["status"] == "success"
    assert (
        await adapter.probe()
    ).models  # tests check shape and counts, never a small model's text

    sink = RecordingSink()
    body = chat("Say hello.", model=REAL_CHAT_MODEL, max_tokens=8, temperature=0)
    completion = await adapter.execute(spec(body, stream=True, seconds=300), sink)
    assert sink.deltas[0].role == "assistant"
    assert completion.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert 0 < completion.usage.completion_tokens <= 8

    body = {"model": REAL_CHAT_MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    done: Completion = await adapter.execute(
        spec(body, operation=Operation.COMPLETIONS, seconds=300), sink
    )
    assert done.result is not None
    assert done.result["choices"][0]["finish_reason"] in ("stop", "length")

    body = {"model": REAL_EMBED_MODEL, "input": ["hello", "world"]}
    embedded = await adapter.execute(spec(body, operation=Operation.EMBEDDINGS, seconds=300), sink)
    assert embedded.result is not None
    assert len(embedded.result["data"]) == 2

    with pytest.raises(InvalidRequest):
        await adapter.execute(spec(chat(model="no-such-model:1b")), sink)
    await adapter.load_model(REAL_CHAT_MODEL)
    assert REAL_CHAT_MODEL in {m["name"] for m in await adapter.running_models()}
    await adapter.unload_model(REAL_CHAT_MODEL)
    await adapter.delete_model(REAL_EMBED_MODEL)


async def test_answers_past_the_limit_are_refused(
    fake: FakeOllama, http: aiohttp.ClientSession
) -> None:
    """A body, or one NDJSON line, past the node's answer limit fails the run as the
    request's (one frame must carry it on to the edge), before it is read whole."""
    config = ProviderConfig(id="ollama-1", type="ollama", settings={"endpoint": fake.url})
    small = OllamaAdapter(config, AdapterContext(http=http, environ={}, max_answer_bytes=64))
    for stream in (False, True):
        with pytest.raises(AnswerTooLarge, match="passed 64 bytes"):
            await small.execute(spec(chat(), stream=stream), RecordingSink())
    answer = await make_adapter(http, fake.url).execute(spec(chat()), RecordingSink())
    assert answer.result is not None  # the default limit: the same answer passes
