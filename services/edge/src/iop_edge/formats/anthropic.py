"""A run's events as Anthropic Messages wire objects: the Message, the SSE events, errors.

Pure, like ``formats.openai``: nothing here does I/O. The node's adapters
answer in the chat-completions shape, so a Message is built from a provider's
chat result (or from the deltas of one that streamed), and a stream from the
same deltas the chat relay writes:

    message_start, ping,
    (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, usage), message_stop

Blocks follow the model's output: reasoning text is a ``thinking`` block, text a
``text`` block, each tool call a ``tool_use`` block, a new block starting when the
kind of output changes. A ``thinking`` block's ``signature`` is the SHA-256 of
its text: IOP signs nothing and verifies nothing (thinking sent back is dropped,
``anthropic_request``), but clients hold the field to be present.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any, Final

from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.errors import ContextLengthExceeded, EdgeError, ProviderFailed
from iop_edge.formats.openai import cached_tokens_of
from iop_proto import json_codec

STOP_REASONS: Final = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED: Final = 529
"""No provider can take the run (none available, the queue timed out, the edge stops):
Anthropic's "overloaded" status, which its clients retry after a pause, instead of 503."""

EPOCH: Final = "1970-01-01T00:00:00Z"
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_PING: Final = b'event: ping\ndata: {"type":"ping"}\n\n'
_STOP: Final = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def sse(name: str, payload: dict[str, Any]) -> bytes:
    """One named SSE event, as Anthropic writes them (``event:`` then ``data:``)."""
    return b"event: " + name.encode() + b"\ndata: " + json_codec.dumps(payload) + b"\n\n"


def error_status(exc: EdgeError) -> int:
    """The HTTP status of ``exc`` on the Messages API (503 becomes 529, see ``OVERLOADED``)."""
    return OVERLOADED if exc.status == 503 else exc.status


def error_body(exc: EdgeError) -> dict[str, Any]:
    """Anthropic's error object, for a response body and for a mid-stream ``error`` event."""
    status = error_status(exc)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = exc.anthropic_message if isinstance(exc, ContextLengthExceeded) else exc.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def model_info(model_id: str, display_name: str) -> dict[str, Any]:
    """Anthropic's ModelInfo (``GET /v1/models/{id}``); IOP keeps no creation time."""
    return {
        "type": "model",
        "id": model_id,
        "display_name": display_name or model_id,
        "created_at": EPOCH,
    }


def model_list(models: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's page of models: the whole catalog in one page."""
    return {
        "data": list(models),
        "has_more": False,
        "first_id": models[0]["id"] if models else None,
        "last_id": models[-1]["id"] if models else None,
    }


def usage_body(usage: Usage | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens NOT read from the cache
    (``cache_read_input_tokens``), as Anthropic counts them; the engines cache on their
    own, so nothing is ever written to a cache on request (``cache_creation_input_tokens``)."""
    usage = usage or Usage()
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(finish_reason: str, *, tool_calls: bool) -> str:
    if tool_calls and finish_reason in ("", "stop", "tool_calls"):
        return "tool_use"
    return STOP_REASONS.get(finish_reason, "end_turn")


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as ``input``: an object; ``{}`` for arguments that are
    empty or not a JSON object (a small model's broken call still reads)."""
    try:
        value = json_codec.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_head(message_id: str, model: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def render_message(
    end: Completed,
    deltas: Sequence[Delta],
    *,
    message_id: str,
    model: str,
    stop_sequences: Sequence[str] = (),
) -> dict[str, Any]:
    """The Message of a non-streamed run: from the provider's chat result when it sent
    one, else from its deltas (a CLI program streams even when asked not to)."""
    if end.result_json:
        return _from_chat_result(end, message_id, model, stop_sequences)
    text: list[str] = []
    thinking: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish, usage = end.finish_reason, end.usage
    for delta in deltas:
        if delta.choice_index:
            continue
        text.append(delta.text)
        thinking.append(delta.reasoning_text)
        for part in delta.tool_calls:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or part.id
            call["name"] += part.function_name
            call["arguments"] += part.function_arguments
        finish = delta.finish_reason or finish
        usage = usage or delta.usage
    blocks = _blocks(
        "".join(thinking), "".join(text), [calls[i] for i in sorted(calls)], message_id
    )
    return _message(message_id, model, blocks, finish, None, usage)


def _from_chat_result(
    end: Completed, message_id: str, model: str, stop_sequences: Sequence[str]
) -> dict[str, Any]:
    try:
        result = json_codec.loads(end.result_json)
    except ValueError:
        raise ProviderFailed("the provider's result is not JSON") from None
    choices = result.get("choices") if isinstance(result, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ProviderFailed("the provider's result has no choice")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        message = {}
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append(
                {
                    "id": str(call.get("id") or ""),
                    "name": str(function.get("name") or ""),
                    "arguments": str(function.get("arguments") or ""),
                }
            )
    # vLLM names the stop string it met (``stop_reason``); other servers do not say.
    matched = choice.get("stop_reason")
    stop_sequence = matched if isinstance(matched, str) and matched in stop_sequences else None
    blocks = _blocks(str(reasoning), str(content or ""), calls, message_id)
    finish = str(choice.get("finish_reason") or end.finish_reason)
    usage = _usage(result.get("usage"), end.usage)
    return _message(message_id, model, blocks, finish, stop_sequence, usage)


def _blocks(
    thinking: str, text: str, calls: Iterable[dict[str, str]], message_id: str
) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": signature(thinking)})
    if text:
        blocks.append({"type": "text", "text": text})
    for index, call in enumerate(calls):
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"] or tool_use_id(message_id, index),
                "name": call["name"],
                "input": tool_input(call["arguments"]),
            }
        )
    return blocks


def _message(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    finish: str,
    stop_sequence: str | None,
    usage: Usage | None,
) -> dict[str, Any]:
    tool_calls = any(block["type"] == "tool_use" for block in blocks)
    reason = "stop_sequence" if stop_sequence else stop_reason(finish, tool_calls=tool_calls)
    return {
        **message_head(message_id, model),
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": usage_body(usage),
    }


def _usage(value: Any, node: Usage | None) -> Usage | None:
    """A chat result's usage (``node``'s, the node's count of the run, when it has none);
    its cached tokens the larger of the two counts (the node also reads llama.cpp's
    ``timings``, where older builds alone report the cache)."""
    if not isinstance(value, dict):
        return node
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return node
    own = cached_tokens_of(value)
    return Usage(
        prompt, completion, prompt + completion, max(own, node.cached_tokens if node else 0)
    )


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


def tool_use_id(message_id: str, index: int) -> str:
    """An id for a tool call the provider left unnamed (``toolu_`` as Anthropic's)."""
    return f"toolu_{message_id.removeprefix('msg_')}_{index}"


class MessageStream:
    """Encodes one run's stream as Anthropic's events; state is only which block is
    open (its index and kind) and what ``message_delta`` will report."""

    __slots__ = (
        "_blocks",
        "_finish",
        "_id",
        "_kind",
        "_model",
        "_text_head",
        "_thinking",
        "_tools",
        "_usage",
    )

    def __init__(self, *, message_id: str, model: str) -> None:
        self._id = message_id
        self._model = model
        self._blocks = 0  # blocks started so far; the open one is ``_blocks - 1``
        self._kind = ""  # the open block's type, "" when none is open
        self._text_head = b""  # the open text block's delta event up to its text
        self._thinking = hashlib.sha256()
        self._tools: dict[int, int] = {}  # a provider's tool-call index -> its block's index
        self._finish = ""
        self._usage: Usage | None = None

    def opening(self) -> bytes:
        message = {
            **message_head(self._id, self._model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_body(None),  # the counts come with message_delta
        }
        return sse("message_start", {"type": "message_start", "message": message}) + _PING

    def delta(self, delta: Delta) -> bytes:
        """The events for one delta (the common token: one template and its text)."""
        if delta.choice_index:
            return b""
        if delta.usage is not None:
            self._usage = delta.usage
        self._finish = delta.finish_reason or self._finish
        out = b""
        if delta.reasoning_text:
            if self._kind != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.update(delta.reasoning_text.encode())
            out += self._delta({"type": "thinking_delta", "thinking": delta.reasoning_text})
        if delta.text:
            if self._kind != "text":
                out += self._start({"type": "text", "text": ""})
            text = _ENCODER.encode(delta.text).encode()
            out += self._text_head + text + b"}}\n\n"
        for call in delta.tool_calls:
            out += self._tool_part(call)
        return out

    def closing(self, end: Completed) -> bytes:
        usage = end.usage or self._usage
        reason = stop_reason(end.finish_reason or self._finish, tool_calls=bool(self._tools))
        tail = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": None},
            "usage": usage_body(usage),  # message_start's were zeros: known only now
        }
        return self._stop() + sse("message_delta", tail) + _STOP

    def failure(self, error: EdgeError) -> bytes:
        return sse("error", error_body(error))

    settle: Final = None
    """Nothing is stored: the last events leave at once."""

    def _tool_part(self, call: ToolCallDelta) -> bytes:
        out = b""
        block = self._tools.get(call.index)
        if block is None:
            out += self._start(
                {
                    "type": "tool_use",
                    "id": call.id or tool_use_id(self._id, len(self._tools)),
                    "name": call.function_name,
                    "input": {},
                }
            )
            block = self._tools[call.index] = self._blocks - 1
        if call.function_arguments:
            # a part of a call whose block was closed (calls interleaved) keeps its own index
            out += self._delta(
                {"type": "input_json_delta", "partial_json": call.function_arguments}, block
            )
        return out

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._stop()
        index = self._blocks
        self._blocks += 1
        self._kind = block["type"]
        if self._kind == "text":
            self._text_head = (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                + str(index).encode()
                + b',"delta":{"type":"text_delta","text":'
            )
        start = {"type": "content_block_start", "index": index, "content_block": block}
        return out + sse("content_block_start", start)

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        at = self._blocks - 1 if index is None else index
        return sse(
            "content_block_delta", {"type": "content_block_delta", "index": at, "delta": delta}
        )

    def _stop(self) -> bytes:
        """Close the open block (a thinking block gets its signature first)."""
        if not self._kind:
            return b""
        index = self._blocks - 1
        out = b""
        if self._kind == "thinking":
            mark = {"type": "signature_delta", "signature": self._thinking.hexdigest()}
            out += self._delta(mark)
            self._thinking = hashlib.sha256()
        self._kind = ""
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": index})
