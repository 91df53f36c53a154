"""One adapter for every provider that speaks the OpenAI HTTP API.

vLLM, SGLang, Lemonade, llama.cpp's server, llama-swap and OpenAI itself differ only in
small facts (lifecycle capabilities, the probe path, their own request fields),
so they share this code and differ by a ``Flavor``. The request body is what the
edge prepared for this provider type (``body_prepared``: the fields the type is sent,
``iop_proto.engine_fields``, the served model and the streaming switches), posted as it
came, never parsed; an older edge's body is prepared here by the same rule. An answer is
read up to ``max_answer_bytes`` and refused past it (``answer_read``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from iop_node.adapters import tokenizer
from iop_node.adapters.answer_read import read_answer
from iop_node.adapters.context_overflow import context_overflow
from iop_node.adapters.provider_http import (
    ProviderConnectionLost,
    ProviderHttpError,
    ProviderResponse,
)
from iop_node.adapters.sse import iter_sse_data
from iop_node.domain.health import ProbeResult
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, ExecutionSpec, Operation, ToolCallDelta, Usage
from iop_node.errors import (
    AnswerTooLarge,
    ConfigError,
    InvalidRequest,
    ProviderFailed,
    ProviderUnavailable,
    RunFailure,
)
from iop_node.ports import (
    Adapter,
    AdapterContext,
    AdapterFactory,
    EngineInfo,
    EventSink,
    LifecycleFlags,
)
from iop_proto import json_codec
from iop_proto.engine_fields import OUTPUT_LENGTH_FIELDS as OUTPUT_LENGTH_FIELDS
from iop_proto.engine_fields import provider_body

PROBE_TIMEOUT_S: Final = 2.0
CONNECT_TIMEOUT_S: Final = 10.0
"""Only the TCP connect has its own bound: a long generation is bounded by the run's
deadline alone."""
ERROR_BODY_LIMIT: Final = 64 * 1024
CLIENT_FAULT_STATUSES: Final = frozenset({400, 404, 422})
NOT_IMPLEMENTED: Final = 501  # the provider does not offer the operation
"""Statuses that mean the request itself is wrong: the client's fault, not the provider's."""

_PATHS: Final[Mapping[Operation, str]] = {
    Operation.CHAT_COMPLETIONS: "/v1/chat/completions",
    Operation.COMPLETIONS: "/v1/completions",
    Operation.EMBEDDINGS: "/v1/embeddings",
}


@dataclass(frozen=True, slots=True)
class Flavor:
    """What distinguishes one OpenAI-compatible provider type from another."""

    provider_type: str
    probe_path: str = "/v1/models"
    lifecycle: LifecycleFlags = field(default_factory=lambda: LifecycleFlags(list_models=True))
    tokenizer: str = ""
    """How the server counts a prompt's tokens (``tokenizer.STYLES``); empty: it cannot."""
    version: tuple[str, str] = ("", "")
    """Where the engine tells its version: (path, JSON field); empty: it does not."""


FLAVORS: Final[Mapping[str, Flavor]] = {
    "vllm": Flavor("vllm", tokenizer=tokenizer.VLLM, version=("/version", "version")),
    "sglang": Flavor("sglang", version=("/get_server_info", "version")),
    # llama.cpp's server: its build (``b<number>-<commit>``) in /props
    "llamacpp": Flavor("llamacpp", tokenizer=tokenizer.LLAMACPP, version=("/props", "build_info")),
    "openai_api": Flavor("openai_api"),
    "llamaswap": Flavor("llamaswap"),  # llama-swap: a proxy starting llama.cpp servers
    "lemonade": Flavor(
        "lemonade",
        lifecycle=LifecycleFlags(
            list_models=True,
            load_model=True,
            unload_model=True,
            pull_model=True,
            delete_model=True,
        ),
    ),
}


def factory(provider_type: str) -> AdapterFactory:
    """The constructor ``bootstrap`` registers for one OpenAI-compatible provider type."""
    try:
        flavor = FLAVORS[provider_type]
    except KeyError:
        known = ", ".join(sorted(FLAVORS))
        raise ConfigError(
            f"{provider_type!r} is not an OpenAI-compatible provider type ({known})"
        ) from None

    def make(config: ProviderConfig, context: AdapterContext) -> Adapter:
        return OpenAICompatAdapter(config, context, flavor=flavor)

    return make


def normalise_endpoint(endpoint: str) -> str:
    """The base URL the API paths (``/v1/...``) hang from, with or without ``/v1`` given.

    ``http://h:8000``, ``http://h:8000/`` and ``http://h:8000/v1`` all become
    ``http://h:8000``; Lemonade's ``http://h:8000/api/v1`` becomes ``http://h:8000/api``.
    """
    base = endpoint.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"endpoint {endpoint!r} is not an http:// or https:// URL")
    return base


class OpenAICompatAdapter:
    """A provider reached over the OpenAI HTTP API (``/v1/chat/completions`` ...).

    Holds no connection of its own: requests go through the node's shared
    client (``provider_http``), and each run's response is closed when the run
    ends, at once on cancellation so the provider sees the disconnect and frees
    its slot.
    """

    def __init__(self, config: ProviderConfig, context: AdapterContext, *, flavor: Flavor) -> None:
        endpoint = config.setting("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(f"provider {config.id!r}: settings.endpoint is required")
        self._flavor = flavor
        if context.engines is None:
            raise ConfigError(f"provider {config.id!r}: the node lent no engine HTTP client")
        self._http = context.engines
        self._max_answer = context.max_answer_bytes
        self._base = normalise_endpoint(endpoint)
        self._headers: dict[str, str] = {}
        # Why the provider cannot be called, decided once: settings are read at start.
        self._key_problem = ""
        key_env = config.setting("api_key_env")
        if key_env:
            key = context.environ.get(str(key_env))
            if key:
                self._headers["Authorization"] = f"Bearer {key}"
            else:
                self._key_problem = f"api_key_env {key_env} is not set in the node's environment"
        self._post_headers = {**self._headers, "Content-Type": "application/json"}

    @property
    def name(self) -> str:
        return self._flavor.provider_type

    def capabilities(self) -> LifecycleFlags:
        return self._flavor.lifecycle

    async def aclose(self) -> None:
        """Nothing to release: the HTTP client belongs to the node."""

    async def probe(self) -> ProbeResult:
        """GET the probe path (``/v1/models``): cheap, and it lists the served models."""
        if self._key_problem:
            return ProbeResult(ok=False, detail=self._key_problem)
        url = self._base + self._flavor.probe_path
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                response = await self._http.request(
                    "GET", url, headers=self._headers, connect_timeout_s=PROBE_TIMEOUT_S
                )
                async with response:
                    status = response.status
                    body = await read_answer(response, self._max_answer)
        except TimeoutError:
            return ProbeResult(ok=False, detail=f"{url}: no answer within {PROBE_TIMEOUT_S:g} s")
        except AnswerTooLarge as exc:
            return ProbeResult(ok=False, detail=f"{url}: {exc.message}")
        except ProviderHttpError as exc:
            return ProbeResult(ok=False, detail=f"{url}: {_describe(exc)}")
        if status >= 400:
            return ProbeResult(ok=False, detail=f"{url}: HTTP {status}: {_error_message(body)}")
        try:
            document = json.loads(body)
        except ValueError:
            return ProbeResult(ok=False, detail=f"{url}: HTTP {status} but the body is not JSON")
        return ProbeResult(ok=True, models=_model_ids(document))

    async def engine(self) -> EngineInfo:
        """The engine's version where its flavor says where to read it (``EngineReporter``);
        any failure leaves it empty: a version is for reports, never for routing."""
        path, field_name = self._flavor.version
        if not path or self._key_problem:
            return EngineInfo(self.name)
        document = await self._get_document(path)
        value = document.get(field_name) if isinstance(document, dict) else None
        return EngineInfo(self.name, version=str(value or ""))

    async def _get_document(self, path: str) -> object:
        """GET ``path`` under the endpoint as JSON, bounded like a probe; ``None`` for any
        failure (no answer, an HTTP error, too large, not JSON): the documents read this
        way (a version, what is loaded) inform, and a provider is judged by ``probe``."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                response = await self._http.request(
                    "GET",
                    self._base + path,
                    headers=self._headers,
                    connect_timeout_s=PROBE_TIMEOUT_S,
                )
                async with response:
                    status = response.status
                    body = await read_answer(response, self._max_answer)
            return json.loads(body) if status < 400 else None
        except (TimeoutError, ValueError, AnswerTooLarge, ProviderHttpError):
            return None

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        """Run ``spec`` on the provider, streaming deltas into ``sink`` when asked to."""
        if self._key_problem:
            raise ProviderUnavailable(self._key_problem)
        if spec.stream and spec.operation is Operation.EMBEDDINGS:
            raise InvalidRequest("embeddings cannot be streamed")
        # The upstream body: the edge's prepared bytes as they came, or (an older edge) the
        # client's body (``model`` already the served name: the edge wrote it) less the
        # fields this type is not sent, with only the streaming switches forced.
        if spec.body_prepared:
            data = spec.body_json
        else:
            data = json_codec.dumps(
                provider_body(spec.body, self.name, spec.operation.value, spec.stream)
            )
        url = self._base + _PATHS[spec.operation]
        began = time.perf_counter()  # the provider's time: the HTTP exchange, not our work
        try:
            response = await self._http.request(
                "POST",
                url,
                body=data,
                headers=self._post_headers,
                connect_timeout_s=CONNECT_TIMEOUT_S,
            )
        except ProviderHttpError as exc:
            # No response at all: refused, DNS, TLS, reset or connect timeout.
            raise ProviderUnavailable(f"{url}: {_describe(exc)}") from exc
        try:
            if response.status >= 400:
                failure = await _http_failure(response, spec)
                response.release()  # read to the end (usually): the connection is reused
                raise failure
            if spec.stream and response.content_type != "application/json":
                completion = await _read_stream(response, spec, sink, self._max_answer, began)
            elif spec.stream:
                # A server that ignored ``stream`` answers with one JSON body: an error
                # object at best, and nothing we could replay as deltas otherwise.
                _read_result(await read_answer(response, self._max_answer), spec.operation)
                raise ProviderFailed(f"{url}: asked for a stream, got one JSON body")
            else:
                # At most a frame's worth, refused past it unparsed (``answer_read``).
                body = await read_answer(response, self._max_answer)
                provider_us = int((time.perf_counter() - began) * 1_000_000)
                completion = _read_result(body, spec.operation, provider_us)
        except ProviderConnectionLost as exc:
            response.close()
            raise ProviderFailed(f"{url}: connection lost mid-response: {_describe(exc)}") from exc
        except BaseException:
            # Cancellation, deadline, sink gone or a bad answer: drop the connection so
            # the provider stops generating (a pooled connection would keep the slot busy).
            response.close()
            raise
        response.release()
        return completion

    async def count_tokens(self, spec: ExecutionSpec) -> Completion:
        """``TokenCounter``: the prompt tokens from the server's own tokenizer."""
        if not self._flavor.tokenizer:
            raise InvalidRequest(
                f"{self.name} servers have no tokenizer endpoint to count tokens with",
                provider_status=NOT_IMPLEMENTED,
            )
        if self._key_problem:
            raise ProviderUnavailable(self._key_problem)
        began = time.perf_counter()
        counted = await tokenizer.prompt_tokens(
            self._flavor.tokenizer, self._http, self._base, self._post_headers, spec.body
        )
        provider_us = int((time.perf_counter() - began) * 1_000_000)
        return Completion(usage=Usage(counted, 0, counted), provider_us=provider_us)


async def _read_stream(
    response: ProviderResponse,
    spec: ExecutionSpec,
    sink: EventSink,
    max_event_bytes: int,
    began: float,
) -> Completion:
    """The stream's deltas into ``sink``; its ``Completion`` carries the provider's time
    since ``began`` (the request's start), as a non-streamed answer's does."""
    text_mode = spec.operation is Operation.COMPLETIONS
    finish_reasons: dict[int, str] = {}
    usage: Any = None  # the last usage object, read once the stream has ended
    timings: Any = None
    # aclosing: a run that stops early (cancelled, sink gone) finalises the reader now,
    # not whenever the garbage collector finds it.
    events_of = iter_sse_data(response, max_event_bytes=max_event_bytes)
    async with contextlib.aclosing(events_of) as events:
        async for data in events:
            try:
                chunk = json_codec.loads(data)
            except ValueError:
                raise ProviderFailed(f"malformed stream chunk: {_tail(data)}") from None
            if not isinstance(chunk, dict):
                raise ProviderFailed(f"stream chunk is not an object: {_tail(data)}")
            if "error" in chunk:
                raise _error_from_object(chunk["error"])
            if chunk.get("usage") and isinstance(chunk["usage"], dict):
                usage = chunk["usage"]  # vLLM's continuous usage: in every chunk
            if chunk.get("timings"):  # llama.cpp: the last chunk(s) carry its timings
                timings = chunk["timings"]
            for choice in chunk.get("choices") or ():
                delta = _choice_delta(choice, text_mode)
                if delta is None:
                    continue
                if delta.finish_reason:
                    finish_reasons[delta.choice_index] = delta.finish_reason
                await sink.delta(delta)
    finish = finish_reasons.get(0) or next(iter(finish_reasons.values()), "")
    provider_us = int((time.perf_counter() - began) * 1_000_000)
    return Completion(
        finish_reason=finish, usage=_usage(usage, timings), result=None, provider_us=provider_us
    )


def _choice_delta(choice: Any, text_mode: bool) -> Delta | None:
    """One choice of a chunk as a ``Delta``; ``None`` when it carries nothing."""
    # A chunk's fields are read as ``_str`` and ``_int`` read them: a null or a stray
    # type is empty (or 0), never an error.
    if not isinstance(choice, dict):
        return None
    index = choice.get("index")
    if type(index) is not int:
        index = 0
    finish = choice.get("finish_reason")
    if not isinstance(finish, str):
        finish = ""
    logprobs = choice.get("logprobs")
    # Forwarded as JSON, written once here (the chunk is parsed already): the edge
    # splices it into its chunk unparsed.
    logprobs_json = json_codec.dumps(logprobs) if logprobs else b""
    if text_mode:
        text = choice.get("text")
        if not isinstance(text, str):
            text = ""
        if not text and not finish:
            return None
        return Delta(
            text=text, choice_index=index, finish_reason=finish, logprobs_json=logprobs_json
        )
    body = choice.get("delta")
    if not isinstance(body, dict):
        body = {}
    text = body.get("content")
    if not isinstance(text, str):
        text = ""
    role = body.get("role")
    if not isinstance(role, str):
        role = ""
    reasoning = body.get("reasoning_content") or body.get("reasoning") or ""
    if not isinstance(reasoning, str):
        reasoning = _str(body.get("reasoning"))  # a stray non-string first: the other
    calls = body.get("tool_calls")
    tool_calls = (
        tuple(_tool_call(call, i) for i, call in enumerate(calls) if isinstance(call, dict))
        if calls
        else ()
    )
    if not (text or role or reasoning or tool_calls or finish):
        return None
    return Delta(
        text=text,
        role=role,
        choice_index=index,
        tool_calls=tool_calls,
        finish_reason=finish,
        reasoning_text=reasoning,
        logprobs_json=logprobs_json,
    )


def _tool_call(call: dict[str, Any], position: int) -> ToolCallDelta:
    function = call.get("function")
    if not isinstance(function, dict):
        function = {}
    index = call.get("index")
    return ToolCallDelta(
        index=index if isinstance(index, int) else position,
        id=_str(call.get("id")),
        type=_str(call.get("type")),
        function_name=_str(function.get("name")),
        function_arguments=_str(function.get("arguments")),
    )


def _read_result(body: bytes, operation: Operation, provider_us: int = 0) -> Completion:
    """The provider's answer to a non-streamed run; its own bytes travel on to the edge."""
    try:
        result = json_codec.loads(body)
    except ValueError:
        raise ProviderFailed(f"response is not JSON: {_tail(body)}") from None
    if not isinstance(result, dict):
        raise ProviderFailed(f"response is not a JSON object: {_tail(body)}")
    if "error" in result:
        raise _error_from_object(result["error"])
    finish = ""
    if operation is not Operation.EMBEDDINGS:
        choices = result.get("choices")
        if choices and isinstance(choices[0], dict):
            finish = _str(choices[0].get("finish_reason"))
    return Completion(
        finish_reason=finish,
        usage=_usage(result.get("usage"), result.get("timings")),
        result=result,
        result_json=body,  # forwarded as it came: the edge's codec reads what json reads
        provider_us=provider_us,
    )


def _usage(value: Any, timings: Any) -> Usage | None:
    """An answer's ``usage`` object, with what llama.cpp's ``timings`` add: the prompt
    tokens it took from its cache (``cache_n``; ``prompt_tokens_details`` says the same in
    newer builds, older ones only there) and the time it spent on the rest (``prompt_ms``
    for ``prompt_n`` tokens), which the node's cache account turns into a prefill rate."""
    if not isinstance(value, dict):
        return None
    # JSON's integers are exactly int (a bool, an int subclass, is not a count): ``_int``
    prompt = value.get("prompt_tokens")
    if type(prompt) is not int:
        prompt = 0
    completion = value.get("completion_tokens")
    if type(completion) is not int:
        completion = 0
    total = value.get("total_tokens")
    if type(total) is not int:
        total = 0
    details = value.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    rate = None
    if isinstance(timings, dict):
        cached = max(cached, _int(timings.get("cache_n")))
        evaluated = _int(timings.get("prompt_n"))
        prompt_ms = timings.get("prompt_ms")
        if evaluated > 0 and isinstance(prompt_ms, (int, float)) and prompt_ms >= 0:
            rate = float(prompt_ms) / evaluated
    total = total or prompt + completion
    return Usage(prompt, completion, total, min(cached, prompt), prefill_ms_per_token=rate)


def _model_ids(document: Any) -> tuple[str, ...]:
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return ()
    return tuple(str(m["id"]) for m in data if isinstance(m, dict) and m.get("id"))


async def _http_failure(response: ProviderResponse, spec: ExecutionSpec) -> RunFailure:
    """The failure an HTTP error status stands for, with the provider's own message.

    A 501 is the provider saying it does not offer the operation (llama.cpp started
    without ``--embeddings``): the client's request cannot succeed there, so it is an
    invalid request naming model and operation, not a provider failure to retry
    elsewhere or to count against the provider."""
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(response.iter_any()) as body_chunks:
        async for chunk in body_chunks:
            chunks.append(chunk)
            size += len(chunk)
            if size >= ERROR_BODY_LIMIT:
                break
    body = b"".join(chunks)
    message = f"HTTP {response.status}: {_error_message(body)}"
    overflow = context_overflow(_error_object(body), message, response.status)
    if overflow is not None:
        return overflow
    if response.status == NOT_IMPLEMENTED:
        return InvalidRequest(
            f"The model '{spec.model}' does not offer {spec.operation.value} on this provider"
            f" ({message})",
            provider_status=NOT_IMPLEMENTED,
        )
    if response.status in CLIENT_FAULT_STATUSES:
        return InvalidRequest(message, provider_status=response.status)
    return ProviderFailed(message, provider_status=response.status)


def _error_from_object(error: Any) -> RunFailure:
    """An ``{"error": ...}`` the provider sent with a 200 (mid-stream, usually)."""
    status = 0
    if isinstance(error, dict):
        message = str(error.get("message") or error)
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code
    else:
        message = str(error)
    message = f"provider error: {message}"
    return context_overflow(error, message, status) or ProviderFailed(
        message, provider_status=status
    )


def _error_object(body: bytes) -> Any:
    """The ``error`` member of an error body (an object or a string), or None."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return document.get("error") if isinstance(document, dict) else None


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error object (or vLLM's, FastAPI's), else the body's tail."""
    try:
        document = json.loads(body)
    except ValueError:
        return _tail(body)
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        for key in ("message", "detail"):
            if document.get(key):
                return str(document[key])
    return _tail(body)


def _str(value: Any) -> str:
    """A string field of a provider's JSON; ``null`` (or a stray non-string) is empty."""
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int:
    # JSON's integers are exactly int (a bool, an int subclass, is not a count)
    return value if type(value) is int else 0


def _tail(body: bytes, limit: int = 500) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
