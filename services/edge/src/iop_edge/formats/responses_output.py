"""A run's output as OpenAI Responses objects: output items, usage, the Response itself.

A run is a chat completion (see ``responses_request``); its answer, whether the
provider's whole chat result or the deltas of a stream, is gathered into one
``Turn`` (reasoning, text, tool calls) and written as Responses output items:
a ``reasoning`` item, a ``message`` with one ``output_text`` part, and one
``function_call`` (or ``custom_tool_call``, for a custom tool) per tool call, in that
order; ``OutputShape`` says how, for one request (the names its tools stand for, whether
reasoning is sealed into ``encrypted_content``). Ids derive from the run's id
(``resp_<run>``, ``msg_<run>``, ``rs_<run>``, ``fc_<run>_<n>``, ``ctc_<run>_<n>``), so
the id a client quotes is the one in the run log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.domain.events import Completed, Delta, Usage
from iop_edge.errors import EdgeError, ProviderFailed
from iop_edge.formats.openai import cached_tokens_of
from iop_edge.formats.responses_tools import Tools, custom_input
from iop_proto import json_codec

INCOMPLETE_REASONS: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""Chat finish reasons that leave a response ``incomplete``, and the reason it then gives."""


def response_id(run_id: str) -> str:
    return f"resp_{run_id}"


def message_id(run_id: str) -> str:
    return f"msg_{run_id}"


def reasoning_id(run_id: str) -> str:
    return f"rs_{run_id}"


def call_item_id(run_id: str, index: int, custom: bool = False) -> str:
    return f"{'ctc' if custom else 'fc'}_{run_id}_{index}"


@dataclass(frozen=True, slots=True)
class OutputShape:
    """How one request's output items are written: what the names of the engine's calls
    stand for, and the sealer of reasoning text when the client asked for
    ``reasoning.encrypted_content`` (None: reasoning is returned in the clear only)."""

    tools: Tools = field(default_factory=Tools)
    seal: Callable[[str], str] | None = None

    def is_custom(self, called: str) -> bool:
        return self.tools.ref(called).kind == "custom"

    def sealed(self, text: str) -> str | None:
        """The ``encrypted_content`` of reasoning ``text`` (None: not asked for)."""
        return None if self.seal is None else self.seal(text)


@dataclass(slots=True)
class Call:
    """One tool call put together from its fragments."""

    call_id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class Turn:
    """What the model said in one run: reasoning, text, tool calls by index."""

    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    calls: dict[int, Call] = field(default_factory=dict)
    finish_reason: str = ""
    usage: Usage | None = None
    usage_details: dict[str, Any] = field(default_factory=dict)

    def add(self, delta: Delta) -> None:
        if delta.reasoning_text:
            self.reasoning.append(delta.reasoning_text)
        if delta.text:
            self.text.append(delta.text)
        for part in delta.tool_calls:
            call = self.calls.setdefault(part.index, Call())
            call.call_id = call.call_id or part.id
            call.name += part.function_name
            call.arguments += part.function_arguments
        self.finish_reason = delta.finish_reason or self.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage

    @classmethod
    def of_run(cls, end: Completed, deltas: list[Delta] | tuple[Delta, ...]) -> Turn:
        """The turn of a run that completed: the provider's chat result when it sent one
        (parsed once), else its deltas."""
        turn = cls()
        if end.result_json:
            turn._read_result(end.result_json)
        else:
            for delta in deltas:
                turn.add(delta)
        turn.finish_reason = end.finish_reason or turn.finish_reason
        turn.usage = end.usage or turn.usage
        return turn

    def _read_result(self, raw: bytes) -> None:
        try:
            result = json_codec.loads(raw)
        except ValueError:
            raise ProviderFailed("the provider's result is not JSON") from None
        choices = result.get("choices") if isinstance(result, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ProviderFailed("the provider's result has no choices")
        choice = choices[0]
        raw_message = choice.get("message")
        message: dict[str, Any] = raw_message if isinstance(raw_message, dict) else {}
        for key in ("reasoning_content", "reasoning"):
            if isinstance(message.get(key), str) and message[key]:
                self.reasoning.append(message[key])
                break
        if isinstance(message.get("content"), str) and message["content"]:
            self.text.append(message["content"])
        for index, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                self.calls[index] = Call(
                    str(call.get("id") or ""),
                    str(function.get("name") or ""),
                    str(function.get("arguments") or ""),
                )
        self.finish_reason = str(choice.get("finish_reason") or "")
        usage = result.get("usage")
        if isinstance(usage, dict):
            self.usage_details = usage

    @property
    def incomplete_reason(self) -> str | None:
        return INCOMPLETE_REASONS.get(self.finish_reason)

    def output(self, run_id: str, shape: OutputShape) -> list[dict[str, Any]]:
        """The Responses output items of this turn, in order."""
        status = "incomplete" if self.incomplete_reason else "completed"
        items: list[dict[str, Any]] = []
        if self.reasoning:
            text = "".join(self.reasoning)
            items.append(
                reasoning_item(reasoning_id(run_id), text, "completed", shape.sealed(text))
            )
        if self.text or not self.calls:
            items.append(message_item(message_id(run_id), "".join(self.text), status))
        for index, call in sorted(self.calls.items()):
            item_id = call_item_id(run_id, index, shape.is_custom(call.name))
            items.append(call_item(item_id, call, "completed", shape))
        return items

    def usage_object(self) -> dict[str, Any]:
        return usage_object(self.usage or Usage(), self.usage_details)


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A message item; ``text`` None: just opened, no part yet."""
    content = [] if text is None else [output_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(
    item_id: str, text: str | None, status: str, sealed: str | None = None
) -> dict[str, Any]:
    """A reasoning item; ``text`` None: just opened. The reasoning is in the clear in
    ``content``, and ``sealed`` (``OutputShape.sealed``) in ``encrypted_content`` when
    the client asked (no summary: the pool has no summariser, so ``summary`` is empty)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    item = {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}
    if sealed is not None:  # the specification types it a string: absent, never null
        item["encrypted_content"] = sealed
    return item


def call_item(item_id: str, call: Call, status: str, shape: OutputShape) -> dict[str, Any]:
    """A ``function_call`` item (the inner name and the ``namespace`` for a namespaced
    function), or a ``custom_tool_call`` with the free-form ``input`` for a custom tool."""
    ref = shape.tools.ref(call.name)
    if ref.kind == "custom":
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "status": status,
            "call_id": call.call_id or item_id,
            "name": ref.name,
            "input": custom_input(call.arguments),
        }
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": call.arguments,
        "call_id": call.call_id or item_id,
        "name": ref.name,
    }
    if ref.namespace is not None:
        item["namespace"] = ref.namespace
    return item


def usage_object(usage: Usage, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """Responses usage; the details a chat result carried (cached, reasoning tokens) kept.

    ``cached_tokens``: the larger of the result's count and the run's (the node's: it also
    reads llama.cpp's ``timings``, and a streamed run has no result), 0 when neither says.
    """
    details = details or {}
    completion = details.get("completion_tokens_details")
    thought = completion.get("reasoning_tokens") if isinstance(completion, dict) else None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": max(cached_tokens_of(details), usage.cached_tokens),
            "cache_write_tokens": 0,  # no provider of the fleet reports it
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": thought if isinstance(thought, int) else 0},
        "total_tokens": usage.total_tokens or usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(
    echo: dict[str, Any],
    run_id: str,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """The Response object: the request's settings (``echo``) and what the run made
    (``completed_at``: when it completed, None until then and for any other end)."""
    return {
        "id": response_id(run_id),
        "object": "response",
        "created_at": int(created),  # the specification types it an integer
        "completed_at": completed_at,
        "status": status,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        **echo,
        "output": output,
        "usage": usage,
    }


def response_error(exc: EdgeError) -> dict[str, Any]:
    """A failed Response's ``error`` (its codes are Responses' own, not HTTP errors')."""
    code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
    return {"code": code, "message": exc.message}
