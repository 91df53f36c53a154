"""The ``ollama`` provider type: OpenAI-shaped runs on Ollama's native API, and back.

The native API (``/api/chat``, ``/api/generate``, ``/api/embed``) rather than
Ollama's own ``/v1`` layer, because only the native side also offers the model
lifecycle (pull, delete, load, unload, ps) and ``keep_alive``, and it reports
exact token counts on every answer. The price is this translation: OpenAI
sampling parameters become Ollama ``options``, content-part arrays become
``content`` + ``images``, tool-call arguments travel as objects, and Ollama's
NDJSON stream (one JSON object per line, the last one ``done: true`` with the
counts) becomes deltas.

Settings: ``endpoint`` (e.g. ``http://127.0.0.1:11434``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from iop_node.adapters.answer_read import read_answer
from iop_node.adapters.context_overflow import context_overflow
from iop_node.adapters.ollama_request import OUTPUT_LENGTH_FIELDS as OUTPUT_LENGTH_FIELDS
from iop_node.adapters.ollama_request import chat_payload, embed_payload, generate_payload
from iop_node.domain.health import ProbeResult
from iop_node.domain.model_load import LoadAccount, LoadState
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, ExecutionSpec, Operation, ToolCallDelta, Usage
from iop_node.errors import (
    AnswerTooLarge,
    ConfigError,
    InvalidRequest,
    ProviderFailed,
    ProviderTimeout,
    ProviderUnavailable,
    RunFailure,
)
from iop_node.ports import AdapterContext, EngineInfo, EventSink, LifecycleFlags
from iop_proto import json_codec

PROBE_TIMEOUT_S = 2.0
ERROR_TEXT_LIMIT = 500


class OllamaAdapter:
    """One Ollama server. Runs are translated per operation; lifecycle calls map 1:1.

    Every call goes through the node's shared ``aiohttp`` session, so the adapter
    owns nothing that needs closing. Lifecycle methods are not part of the
    ``Adapter`` port (yet): callers bound them with ``asyncio.timeout`` (a pull
    may take minutes) and get the same ``RunFailure`` subclasses as runs do.
    """

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        endpoint = config.setting("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"provider {config.id}: ollama needs an http(s) settings.endpoint")
        self._base = endpoint.rstrip("/")
        self._http = context.http
        self._max_answer = context.max_answer_bytes
        # What the server holds in memory (``/api/ps`` at each probe, ``load_duration``
        # in each answer): the edge schedules around loads by it.
        max_loaded = config.setting("max_loaded_models", 0)
        self._loads = LoadAccount(max_loaded if isinstance(max_loaded, int) else 0)

    @property
    def name(self) -> str:
        return "ollama"

    def capabilities(self) -> LifecycleFlags:
        return LifecycleFlags(
            list_models=True, load_model=True, unload_model=True, pull_model=True, delete_model=True
        )

    async def aclose(self) -> None:
        """Nothing to release: the HTTP session is the node's, not the adapter's."""

    async def probe(self) -> ProbeResult:
        """List the installed models (``/api/tags``): cheap, and proves the server answers."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                models = await self.list_models()
        except RunFailure as exc:
            return ProbeResult(ok=False, detail=exc.message)
        except TimeoutError:
            detail = f"ollama at {self._base} sent no model list within {PROBE_TIMEOUT_S:g} s"
            return ProbeResult(ok=False, detail=detail)
        names = (str(m.get("name") or m.get("model") or "") for m in models)
        await self._read_loaded()
        return ProbeResult(ok=True, models=tuple(name for name in names if name))

    def load_state(self) -> LoadState:
        """The models in memory and the load times seen (``LoadReporter``)."""
        return self._loads.state()

    async def _read_loaded(self) -> None:
        """``/api/ps`` into the load account; a server that does not answer it keeps the
        account as the answers left it (the probe judges health by ``/api/tags``)."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                running = await self.running_models()
        except (RunFailure, TimeoutError):
            return
        entries = [
            (str(m.get("name") or m.get("model") or ""), _unix_ms(m.get("expires_at")))
            for m in running
        ]
        self._loads.listed([e for e in entries if e[0]], time.time_ns() // 1_000_000)

    def _answered(self, spec: ExecutionSpec, final: dict[str, Any]) -> None:
        load_ns = final.get("load_duration")
        load_ms = load_ns // 1_000_000 if isinstance(load_ns, int) and load_ns > 0 else 0
        self._loads.answered(spec.target, load_ms, time.time_ns() // 1_000_000)

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        if spec.operation is Operation.EMBEDDINGS:
            return await self._embed(spec)
        if spec.operation is Operation.CHAT_COMPLETIONS:
            path, payload = "/api/chat", chat_payload(spec)
        else:
            path, payload = "/api/generate", generate_payload(spec)
        if spec.stream:
            return await self._stream(spec, path, payload, sink)
        answer = await self._request("POST", path, payload)
        self._answered(spec, answer)
        return _completion(spec, answer)

    async def engine(self) -> EngineInfo:
        """Ollama's version (``/api/version``), for qualification reports; "" when it
        does not answer (``EngineReporter``)."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                answer = await self._request("GET", "/api/version")
        except (RunFailure, TimeoutError):
            return EngineInfo("ollama")
        return EngineInfo("ollama", version=str(answer.get("version") or ""))

    # ------------------------------------------------------------ model lifecycle

    async def list_models(self) -> list[dict[str, Any]]:
        """The installed models, as Ollama describes them (``name``, ``size``, ``details`` ...)."""
        return _models(await self._request("GET", "/api/tags"))

    async def running_models(self) -> list[dict[str, Any]]:
        """The models loaded in memory now (``/api/ps``), with ``expires_at`` and sizes."""
        return _models(await self._request("GET", "/api/ps"))

    async def pull_model(self, name: str) -> dict[str, Any]:
        """Download a model; returns Ollama's final status (``{"status": "success"}``)."""
        return await self._request("POST", "/api/pull", {"model": name, "stream": False})

    async def delete_model(self, name: str) -> None:
        """Remove an installed model; an unknown one raises ``InvalidRequest`` (404)."""
        await self._request("DELETE", "/api/delete", {"model": name})

    async def load_model(self, name: str, keep_alive: str | int = "5m") -> None:
        """Load a model into memory (a generate with no prompt) and keep it for ``keep_alive``."""
        await self._request(
            "POST", "/api/generate", {"model": name, "keep_alive": keep_alive, "stream": False}
        )

    async def unload_model(self, name: str) -> None:
        """Free a model's memory now (``keep_alive`` 0)."""
        await self._request(
            "POST", "/api/generate", {"model": name, "keep_alive": 0, "stream": False}
        )

    # ------------------------------------------------------------ operations

    async def _embed(self, spec: ExecutionSpec) -> Completion:
        answer = await self._request("POST", "/api/embed", embed_payload(spec))
        vectors = answer.get("embeddings")
        if not isinstance(vectors, list):
            raise ProviderFailed("ollama's embed answer has no embeddings list")
        as_base64 = spec.body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": _packed(vector) if as_base64 else vector,
            }
            for index, vector in enumerate(vectors)
        ]
        usage = Usage.of(_count(answer, "prompt_eval_count"), 0)
        result = {
            "object": "list",
            "data": data,
            "model": spec.target,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens},
        }
        return Completion(usage=usage, result=result)

    async def _stream(
        self, spec: ExecutionSpec, path: str, payload: dict[str, Any], sink: EventSink
    ) -> Completion:
        chat = spec.operation is Operation.CHAT_COMPLETIONS
        role = "assistant" if chat else ""
        calls = 0
        final: dict[str, Any] | None = None
        async with self._open("POST", path, payload) as response:
            # Read to the end (not just to the done line) so the connection can be reused.
            while (chunk := await _next_object(response, self._max_answer)) is not None:
                text, reasoning, raw_calls = _pieces(chunk, chat)
                tool_calls = tuple(
                    _tool_call_delta(spec.run_id, calls + i, call)
                    for i, call in enumerate(raw_calls)
                )
                calls += len(tool_calls)
                if text or reasoning or tool_calls:
                    await sink.delta(
                        Delta(text=text, role=role, reasoning_text=reasoning, tool_calls=tool_calls)
                    )
                    role = ""
                if chunk.get("done") and final is None:
                    final = chunk
        if final is None:
            raise ProviderFailed("ollama's stream ended before its final (done) line")
        self._answered(spec, final)
        if role:
            await sink.delta(Delta(role=role))  # an empty answer: the client still learns who spoke
        return Completion(finish_reason=_finish_reason(final, calls), usage=_usage(final))

    # ------------------------------------------------------------ HTTP

    async def _request(
        self, method: str, path: str, payload: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        async with self._open(method, path, payload) as response:
            return await _read_object(response, self._max_answer)

    @contextlib.asynccontextmanager
    async def _open(
        self, method: str, path: str, payload: dict[str, Any] | None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send a request and yield the response once its status is known to be good.

        Failures before the answer mean the server is unreachable
        (``ProviderUnavailable``); an error status becomes ``ProviderFailed`` (404,
        Ollama's "model not found", ``InvalidRequest``); a connection that breaks
        while the body is read is ``ProviderFailed``. Leaving the context releases
        the response, and an unfinished body closes the connection: that is how a
        cancelled run aborts the HTTP call.
        """
        url = self._base + path
        try:
            response = await self._http.request(method, url, json=payload)
        except aiohttp.ServerTimeoutError as exc:
            raise ProviderTimeout(f"ollama at {self._base} timed out: {exc}") from exc
        except aiohttp.ClientConnectionError as exc:
            raise ProviderUnavailable(f"cannot reach ollama at {self._base}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise ProviderFailed(f"ollama request {method} {path} failed: {exc}") from exc
        async with response:
            if response.status >= 400:
                raise await _status_failure(response, path)
            try:
                yield response
            except aiohttp.ClientError as exc:
                raise ProviderFailed(f"ollama's answer to {path} broke off: {exc}") from exc


async def _status_failure(response: aiohttp.ClientResponse, path: str) -> RunFailure:
    text = (await response.read()).decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
        message = str(parsed["error"]) if isinstance(parsed, dict) else text
    except (ValueError, KeyError):
        message = text.strip()[:ERROR_TEXT_LIMIT] or (response.reason or "")
    detail = f"ollama {path} answered {response.status}: {message}"
    overflow = context_overflow(None, detail, response.status)
    if overflow is not None:
        return overflow
    if response.status == 404:
        return InvalidRequest(detail, provider_status=404)
    return ProviderFailed(detail, provider_status=response.status)


def _parse(raw: bytes) -> dict[str, Any]:
    """One JSON object; an ``{"error": ...}`` object (Ollama's way, even mid-stream) raises."""
    try:
        value = json_codec.loads(raw)  # one per streamed line: the fast parser first
    except ValueError as exc:
        raise ProviderFailed(f"ollama sent invalid JSON: {raw[:100]!r}") from exc
    if not isinstance(value, dict):
        raise ProviderFailed(f"ollama sent {type(value).__name__} where an object was expected")
    if "error" in value:
        message = f"ollama: {value['error']}"
        raise context_overflow(None, message, 0) or ProviderFailed(message)
    return value


async def _read_object(response: aiohttp.ClientResponse, limit: int) -> dict[str, Any]:
    raw = await read_answer(response, limit)  # at most a frame's worth (answer_read)
    return _parse(raw) if raw.strip() else {}  # /api/delete answers 200 with no body


async def _next_object(response: aiohttp.ClientResponse, limit: int) -> dict[str, Any] | None:
    """The next NDJSON object of a stream, or None at its end (blank lines skipped); a
    line past ``limit`` bytes is refused before it is whole (one frame carries it on)."""
    while line := await _line(response, limit):
        if line.strip():
            return _parse(line)
    return None


async def _line(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """One line of at most ``limit`` bytes (aiohttp's own default, 128 KiB, is too small
    for a tool call with large arguments; a server that never ends a line is refused)."""
    try:
        return await response.content.readline(max_line_length=limit)
    except LineTooLong:
        raise AnswerTooLarge(limit) from None


def _pieces(chunk: dict[str, Any], chat: bool) -> tuple[str, str, list[Any]]:
    """Text, reasoning text and raw tool calls of one Ollama answer (or stream line)."""
    if not chat:
        return str(chunk.get("response") or ""), str(chunk.get("thinking") or ""), []
    message = chunk.get("message") or {}
    if not isinstance(message, dict):
        raise ProviderFailed("ollama sent a message that is not an object")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ProviderFailed("ollama sent tool_calls that are not a list")
    return str(message.get("content") or ""), str(message.get("thinking") or ""), calls


def _tool_call_delta(run_id: str, index: int, call: Any) -> ToolCallDelta:
    """Ollama sends whole calls with object arguments; OpenAI wants an id and a JSON string."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not function.get("name"):
        raise ProviderFailed("ollama sent a tool call without a function name")
    arguments = function.get("arguments", {})
    return ToolCallDelta(
        index=index,
        id=f"call_{run_id[-12:]}_{index}",
        type="function",
        function_name=str(function["name"]),
        function_arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
    )


def _finish_reason(final: dict[str, Any], tool_calls: int) -> str:
    """OpenAI's reason from ``done_reason``: Ollama says "stop" even when it called tools."""
    if final.get("done_reason") == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _count(answer: dict[str, Any], key: str) -> int:
    value = answer.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _usage(final: dict[str, Any]) -> Usage:
    # prompt_eval_count is absent when the whole prompt came from Ollama's cache.
    return Usage.of(_count(final, "prompt_eval_count"), _count(final, "eval_count"))


def _usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _completion(spec: ExecutionSpec, answer: dict[str, Any]) -> Completion:
    """The OpenAI ``chat.completion`` or ``text_completion`` body of a non-streamed answer."""
    chat = spec.operation is Operation.CHAT_COMPLETIONS
    text, reasoning, raw_calls = _pieces(answer, chat)
    calls = [_tool_call_delta(spec.run_id, i, call) for i, call in enumerate(raw_calls)]
    finish_reason = _finish_reason(answer, len(calls))
    usage = _usage(answer)
    choice: dict[str, Any] = {"index": 0}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function_name, "arguments": call.function_arguments},
                }
                for call in calls
            ]
        choice["message"] = message
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    result = {
        "id": f"chatcmpl-{spec.run_id}" if chat else f"cmpl-{spec.run_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": spec.target,
        "choices": [choice],
        "usage": _usage_body(usage),
    }
    return Completion(finish_reason=finish_reason, usage=usage, result=result)


def _models(answer: dict[str, Any]) -> list[dict[str, Any]]:
    models = answer.get("models") or []
    if not isinstance(models, list):
        raise ProviderFailed("ollama's model list is not a list")
    return [m for m in models if isinstance(m, dict)]


def _unix_ms(stamp: Any) -> int:
    """Ollama's ``expires_at`` (RFC 3339, nanoseconds and all) in Unix ms; 0 unknown."""
    if not isinstance(stamp, str) or not stamp:
        return 0
    head, dot, rest = stamp.partition(".")
    if dot:  # fromisoformat takes at most 6 fractional digits
        digits = len(rest) - len(rest.lstrip("0123456789"))
        rest = rest[:digits][:6] + rest[digits:]
        stamp = f"{head}.{rest}"
    try:
        return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        return 0


def _packed(vector: Any) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32s, base64-encoded."""
    if not isinstance(vector, list):
        raise ProviderFailed("ollama sent an embedding that is not a list")
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
