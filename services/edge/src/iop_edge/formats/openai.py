"""A run's events (``domain.events``) as OpenAI wire objects: SSE chunks and whole results.

This is the per-token hot path. A stream's constant part (id, object, created,
public model id) is serialised once when the stream starts. The common token (a
plain text fragment of choice 0) is then written into a byte template with only
its string JSON-escaped (a property test holds it to what the general path writes);
anything else (role, tool calls, reasoning, finish) goes through a small dict
and ``iop_proto.json_codec`` (orjson, the C encoder; the whole results of
non-streamed runs go through it too). Nothing here does I/O, so every function
can be tested on its own.

The client only ever sees the PUBLIC model id: chunks are built here from
deltas, and a provider's whole result has its ``model`` replaced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.domain.fleet import Operation
from iop_edge.errors import EdgeError, ProviderFailed
from iop_edge.formats.errors import error_payload
from iop_proto import json_codec

RENDER_OFFLOAD_BYTES: Final = 256 * 1024
"""A provider result larger than this (embeddings of many inputs) is re-serialised
in a worker thread, so the event loop keeps serving streams meanwhile."""

DONE: Final = b"data: [DONE]\n\n"
_EVENT_END: Final = b"\n\n"
_TOKEN_CHOICE_END: Final = b',"logprobs":null,"finish_reason":null}]'
_CHUNK_END: Final = b"}"
_CHUNK_END_NO_USAGE_YET: Final = b',"usage":null}'
"""With ``stream_options.include_usage`` every chunk but the last says ``"usage":null``
(as OpenAI's do); the last one, with no choices, carries the usage."""

# Stateless and reused: ``json.dumps`` with options builds a new encoder on every call.
# Kept for the common token: one string, where the stdlib's C escaper is as fast.
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(value: Any) -> str:
    """Compact JSON as text (UTF-8 kept as is), for callers that store it as such."""
    return json_codec.dumps(value).decode()


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event (used for errors; chunks go through ``ChunkStream``)."""
    return b"data: " + json_codec.dumps(payload) + _EVENT_END


def usage_object(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` always, 0 when the engine
    said nothing of its cache (as OpenAI's own answers carry it)."""
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": usage.total_tokens or prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def tool_call_delta(call: ToolCallDelta) -> dict[str, Any]:
    """A streamed tool-call fragment: ``id``/``type``/``name`` only when the node sent them."""
    function: dict[str, str] = {}
    if call.function_name:
        function["name"] = call.function_name
    if call.function_arguments or call.function_name:
        function["arguments"] = call.function_arguments
    out: dict[str, Any] = {"index": call.index}
    if call.id:
        out["id"] = call.id
    if call.type or call.id:
        out["type"] = call.type or "function"
    out["function"] = function
    return out


def chat_choice(delta: Delta, *, first: bool) -> dict[str, Any]:
    """A ``chat.completion.chunk`` choice; the first of a choice names the role."""
    body: dict[str, Any] = {}
    if delta.role:
        body["role"] = delta.role
    elif first:
        body["role"] = "assistant"
    if delta.text:
        body["content"] = delta.text
    if delta.reasoning_text:
        body["reasoning_content"] = delta.reasoning_text
    if delta.tool_calls:
        body["tool_calls"] = [tool_call_delta(call) for call in delta.tool_calls]
    return {
        "index": delta.choice_index,
        "delta": body,
        "logprobs": None,
        "finish_reason": delta.finish_reason or None,
    }


def text_choice(delta: Delta) -> dict[str, Any]:
    """A streamed ``text_completion`` choice (``/v1/completions``)."""
    return {
        "index": delta.choice_index,
        "text": delta.text,
        "logprobs": None,
        "finish_reason": delta.finish_reason or None,
    }


class ChunkStream:
    """Encodes one run's stream: chunks, the closing finish chunk, the usage chunk, and
    ``[DONE]`` (the ``StreamWriter`` of OpenAI's chat and text completions).

    Stateful only in what OpenAI's framing needs: which choices have spoken
    (the first chunk carries the role) and which have finished (a provider that
    reports ``finish_reason`` only in ``complete`` still gets a closing chunk).
    """

    __slots__ = (
        "_chat",
        "_end",
        "_finished",
        "_head",
        "_include_usage",
        "_seen",
        "_token_end",
        "_token_head",
        "usage",
    )

    def __init__(
        self,
        operation: Operation,
        *,
        run_id: str,
        model: str,
        created: int,
        include_usage: bool = False,
    ) -> None:
        self._chat = operation is Operation.CHAT_COMPLETIONS
        if self._chat:
            head = {"id": f"chatcmpl-{run_id}", "object": "chat.completion.chunk"}
        else:
            head = {"id": f"cmpl-{run_id}", "object": "text_completion"}
        # '{"id":...,"model":"m"}' without its closing brace: each chunk appends its choices.
        envelope = json_codec.dumps({**head, "created": created, "model": model})[:-1]
        self._head = b"data: " + envelope + b',"choices":'
        opening = b'[{"index":0,"delta":{"content":' if self._chat else b'[{"index":0,"text":'
        self._token_head = self._head + opening
        self._include_usage = include_usage
        self._end = (_CHUNK_END_NO_USAGE_YET if include_usage else _CHUNK_END) + _EVENT_END
        self._token_end = _TOKEN_CHOICE_END + self._end
        self._seen: set[int] = set()
        self._finished: set[int] = set()
        self.usage: Usage | None = None  # the last usage a delta carried (rare)

    def delta(self, delta: Delta) -> bytes:
        """The SSE event for one delta."""
        index = delta.choice_index
        if (
            index in self._seen
            and index == 0
            and delta.text
            and not (delta.role or delta.reasoning_text or delta.tool_calls or delta.finish_reason)
            and delta.usage is None
            and not delta.logprobs_json
        ):
            # The common token: a template and one escaped string (same JSON as below).
            text = _ENCODER.encode(delta.text).encode()
            return self._token_head + (text + b"}" if self._chat else text) + self._token_end
        if delta.finish_reason:
            self._finished.add(index)
        if delta.usage is not None:
            self.usage = delta.usage
        if self._chat:
            first = index not in self._seen
            if first:
                self._seen.add(index)
            choice = chat_choice(delta, first=first)
        else:
            self._seen.add(index)
            choice = text_choice(delta)
        logprobs = delta.logprobs_json
        if logprobs:
            # the provider's logprobs (JSON the node forwarded as it came) spliced in whole
            # rather than parsed and written again
            del choice["logprobs"]
            body = json_codec.dumps(choice)[:-1] + b',"logprobs":' + logprobs + b"}"
        else:
            body = json_codec.dumps(choice)
        return self._head + b"[" + body + b"]" + self._end

    opening: Final = None
    """Nothing goes out before the first delta: OpenAI's stream starts with a chunk."""

    def closing(self, end: Completed) -> bytes:
        """The closing chunks of choices whose deltas never said why they ended (a provider
        may say it only in its completion), the usage chunk when asked
        (``stream_options``), ``[DONE]``."""
        reason = end.finish_reason or "stop"
        tail = b""
        for index in sorted(self._seen or {0}):
            if index in self._finished:
                continue
            if self._chat:
                body: dict[str, Any] = {} if index in self._seen else {"role": "assistant"}
                choice: dict[str, Any] = {"index": index, "delta": body}
            else:
                choice = {"index": index, "text": ""}
            choice["logprobs"] = None
            choice["finish_reason"] = reason
            tail += self._head + b"[" + json_codec.dumps(choice) + b"]" + self._end
        if self._include_usage:
            tail += self.usage_chunk(end)
        return tail + DONE

    def failure(self, error: EdgeError) -> bytes:
        return sse_event(error_payload(error)) + DONE

    settle: Final = None
    """Nothing is stored: the last events leave at once."""

    def usage_chunk(self, complete: Completed) -> bytes:
        """The ``stream_options.include_usage`` chunk: no choices, the run's usage."""
        usage = complete.usage or self.usage or Usage()
        return self._head + b'[],"usage":' + json_codec.dumps(usage_object(usage)) + b"}\n\n"


def render_result(
    operation: Operation,
    complete: Completed,
    deltas: Iterable[Delta],
    *,
    run_id: str,
    model: str,
    created: int,
) -> bytes:
    """The body of a non-streaming answer, with ``model`` the public id.

    The provider's own result (``result_json``) is parsed once and returned with
    ``model`` the public id, ``id`` the edge's (``chatcmpl-<run id>``, ``cmpl-<run id>``:
    the id the client can quote to the operator, whatever the provider called it),
    and the fields OpenAI's reference always sends filled in where the provider left
    them out (``choices[].logprobs``, ``message.refusal``: null); every other field is
    the provider's. A provider that reported deltas instead (a CLI program) gets an
    OpenAI result built from them.
    """
    if complete.result_json:
        try:
            result = json_codec.loads(complete.result_json)
        except ValueError:
            raise ProviderFailed("the provider's result is not JSON") from None
        if not isinstance(result, dict):
            raise ProviderFailed("the provider's result is not a JSON object")
        result["model"] = model
        if operation is not Operation.EMBEDDINGS:
            _complete_choices(operation, result, run_id)
            _complete_usage(result, complete.usage)
        return json_codec.dumps(result)
    if operation is Operation.EMBEDDINGS:
        raise ProviderFailed("the provider returned no embeddings")
    result = _result_from_deltas(operation, complete, deltas, run_id, model, created)
    return json_codec.dumps(result)


def _complete_choices(operation: Operation, result: dict[str, Any], run_id: str) -> None:
    """The edge's id, and the always-present fields of OpenAI's choices, in a provider's
    chat or text completion (llama.cpp leaves ``refusal`` out, some servers ``logprobs``)."""
    chat = operation is Operation.CHAT_COMPLETIONS
    result["id"] = f"{'chatcmpl' if chat else 'cmpl'}-{run_id}"
    choices = result.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        choice.setdefault("logprobs", None)
        message = choice.get("message") if chat else None
        if isinstance(message, dict):
            message.setdefault("refusal", None)


def cached_tokens_of(usage: Mapping[str, Any]) -> int:
    """The prompt tokens an engine's OpenAI-shaped ``usage`` says it served from its cache
    (``prompt_tokens_details.cached_tokens``); 0 when it says nothing (or not a number)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int else 0  # JSON's integers exactly: not a bool


def _complete_usage(result: dict[str, Any], usage: Usage | None) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` in a provider's chat or text result:
    the larger of its own and the node's count (the node also reads llama.cpp's
    ``timings.cache_n``, which older builds report the cache in, and nowhere else), 0 when
    neither says; a result without usage gets the node's whole."""
    body = result.get("usage")
    if not isinstance(body, dict):
        if usage is not None:
            result["usage"] = usage_object(usage)
        return
    own = cached_tokens_of(body)
    details = body.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = body["prompt_tokens_details"] = {}
    details["cached_tokens"] = max(own, usage.cached_tokens if usage is not None else 0)


def _result_from_deltas(
    operation: Operation,
    complete: Completed,
    deltas: Iterable[Delta],
    run_id: str,
    model: str,
    created: int,
) -> dict[str, Any]:
    choices: dict[int, _Choice] = {}
    usage = complete.usage
    for delta in deltas:
        choices.setdefault(delta.choice_index, _Choice()).add(delta)
        if usage is None and delta.usage is not None:
            usage = delta.usage
    if not choices:
        choices[0] = _Choice()
    chat = operation is Operation.CHAT_COMPLETIONS
    rendered = [
        choices[i].as_chat(i, complete.finish_reason) if chat else choices[i].as_text(i, complete)
        for i in sorted(choices)
    ]
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{run_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": rendered,
        "usage": usage_object(usage if usage is not None else Usage()),
    }


class _Choice:
    """One choice's deltas put back together (text, reasoning, tool calls by index)."""

    def __init__(self) -> None:
        self.role = ""
        self.parts: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason = ""
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: Delta) -> None:
        self.role = self.role or delta.role
        if delta.text:
            self.parts.append(delta.text)
        if delta.reasoning_text:
            self.reasoning.append(delta.reasoning_text)
        self.finish_reason = delta.finish_reason or self.finish_reason
        for part in delta.tool_calls:
            call = self.calls.setdefault(
                part.index, {"id": "", "type": "function", "name": "", "arguments": ""}
            )
            call["id"] = call["id"] or part.id
            call["type"] = part.type or call["type"]
            call["name"] += part.function_name
            call["arguments"] += part.function_arguments

    def as_chat(self, index: int, fallback_reason: str) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": None,
            "refusal": None,
        }
        if self.parts:
            message["content"] = "".join(self.parts)
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": call["type"],
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
                for _, call in sorted(self.calls.items())
            ]
        default = "tool_calls" if self.calls else "stop"
        return {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": self.finish_reason or fallback_reason or default,
        }

    def as_text(self, index: int, complete: Completed) -> dict[str, Any]:
        return {
            "index": index,
            "text": "".join(self.parts),
            "logprobs": None,
            "finish_reason": self.finish_reason or complete.finish_reason or "stop",
        }
