"""An OpenAI Responses request read, checked, and written as a chat-completions body.

Every node adapter takes the chat-completions shape, so a Responses request
runs as a chat completion: ``instructions`` and the input items (with those of
a ``previous_response_id`` chain in front) become ``messages``, function tools
become chat tools, ``max_output_tokens`` becomes ``max_tokens`` (held to the
model's cap by the pipeline like chat's own), ``text.format`` becomes
``response_format``, ``reasoning.effort`` becomes ``reasoning_effort``. What
only the Responses object carries (``store``, ``include``, ``metadata``,
``truncation``) stays here, to be echoed in the answer. Pure: no I/O, so every
rule is tested on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.errors import InvalidRequest
from iop_edge.formats.responses_compaction import COMPACTION_TYPES, compaction_context
from iop_edge.formats.responses_tools import (
    Tools,
    custom_arguments,
    flat_name,
    read_tool_choice,
    read_tools,
    restricted,
)

ROLES: Final = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text", "summary_text", "refusal"})
REFUSED_FIELDS: Final = {
    "background": "Background responses are not supported by this server.",
    "conversation": "Conversations are not supported by this server; use previous_response_id.",
    "prompt": "Prompt templates are not supported by this server.",
}
"""Fields whose meaning this server cannot honour: refused (400) rather than ignored."""
MAX_METADATA_PAIRS: Final = 16
SKIPPED_ITEMS: Final = frozenset(
    {
        "compaction",
        "compaction_summary",
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "computer_call",
        "computer_call_output",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
    }
)
"""Input items accepted and not shown to the model: what only OpenAI's service can read
(a compaction's ciphertext) or the calls of hosted tools this pool drops."""
ENCRYPTED_REASONING: Final = "reasoning.encrypted_content"
SERVICE_TIER: Final = "default"
"""The one tier this pool serves; the Response says so whatever was asked."""


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """What a Responses request asks for, checked; ``items`` are this request's own input."""

    model: str
    stream: bool
    store: bool
    items: list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Tools = field(default_factory=Tools)
    tool_choice: Any = "auto"
    chat_tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    include: list[str] = field(default_factory=list)
    truncation: str = "disabled"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @property
    def sealed_reasoning(self) -> bool:
        """Whether the client asked for its reasoning items' ``encrypted_content``."""
        return ENCRYPTED_REASONING in self.include

    @property
    def echo(self) -> dict[str, Any]:
        """The request's settings as the Response object repeats them (every field the
        Open Responses specification requires of it, 2026-04-24)."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata,
            "model": self.model,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {
                "effort": self.reasoning.get("effort"),
                "summary": self.reasoning.get("summary"),
            },
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools.echo,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "top_logprobs": self.top_logprobs or 0,
            "truncation": self.truncation,
            "user": self.user,
            "background": False,
            "service_tier": SERVICE_TIER,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
            "prompt_cache_retention": self.prompt_cache_retention,
        }


def read_request(body: Mapping[str, Any]) -> ResponsesRequest:
    """The checked request; ``InvalidRequest`` naming the field otherwise."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("You must provide a model parameter (a string).", param="model")
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) not in (None, False):
            raise InvalidRequest(why, param=name)
    previous = _optional(body, "previous_response_id", str)
    items = read_input(body.get("input"))
    if not items and previous is None:
        raise InvalidRequest("'input' is required: a string or an array of items.", param="input")
    tools = read_tools(body.get("tools"))
    tool_choice, chat_tool_choice = read_tool_choice(body.get("tool_choice"), tools)
    return ResponsesRequest(
        model=model,
        stream=bool(_optional(body, "stream", bool)),
        store=_optional(body, "store", bool) is not False,
        items=items,
        instructions=_optional(body, "instructions", str),
        previous_response_id=previous,
        tools=tools,
        tool_choice=tool_choice,
        chat_tool_choice=chat_tool_choice,
        parallel_tool_calls=_optional(body, "parallel_tool_calls", bool) is not False,
        max_output_tokens=body.get("max_output_tokens"),  # checked and clamped as chat's (limits)
        max_tool_calls=_count(body, "max_tool_calls"),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        presence_penalty=_number(body, "presence_penalty"),
        frequency_penalty=_number(body, "frequency_penalty"),
        top_logprobs=_count(body, "top_logprobs"),
        text=_text(body.get("text")),
        reasoning=_optional(body, "reasoning", dict) or {},
        metadata=_metadata(body.get("metadata")),
        include=_strings(body, "include"),
        truncation=_optional(body, "truncation", str) or "disabled",
        user=_optional(body, "user", str),
        safety_identifier=_optional(body, "safety_identifier", str),
        prompt_cache_key=_optional(body, "prompt_cache_key", str),
        prompt_cache_retention=_optional(body, "prompt_cache_retention", str),
    )


def read_input(value: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items, each checked; a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("'input' must be a string or an array of items.", param="input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


OpenReasoning = Callable[[str], "str | None"]
"""Opens a reasoning item's ``encrypted_content`` (None: not one this edge can open)."""


def chat_body(
    request: ResponsesRequest,
    history: Sequence[Mapping[str, Any]],
    open_reasoning: OpenReasoning | None = None,
) -> dict[str, Any]:
    """The chat-completions body that runs ``request`` after ``history`` (the items of
    its ``previous_response_id`` chain, oldest first). A reasoning item this edge sealed
    goes back as the ``reasoning_content`` of the assistant turn that follows it (the
    field llama.cpp, vLLM and the node's adapters read), as does one of ``history`` (the
    edge's own store) in the clear; any other is not shown."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    reasoning: str | None = None
    kept = len(history)
    for index, item in enumerate((*history, *request.items)):
        if item.get("type") == "reasoning":
            text = _opened(item, open_reasoning)
            if text is None and index < kept:
                text = _text_of(item.get("content") or ())
            reasoning = text or reasoning
            continue
        if not _append_message(messages, item):
            continue
        last = messages[-1]
        if reasoning and last["role"] == "assistant" and "reasoning_content" not in last:
            last["reasoning_content"] = reasoning
        reasoning = None
    if not messages:
        raise InvalidRequest("The request has no input to answer.", param="input")
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    tools, choice = restricted(request.tools.chat, request.chat_tool_choice)
    if request.max_tool_calls == 0:
        choice = "none"
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = choice
        chat["parallel_tool_calls"] = request.parallel_tool_calls
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None:
            chat[name] = value
    response_format = _response_format(request.text.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = request.reasoning.get("effort")
    if isinstance(effort, str):
        chat["reasoning_effort"] = effort
    if request.user:
        chat["user"] = request.user
    return chat


def _opened(item: Mapping[str, Any], open_reasoning: OpenReasoning | None) -> str | None:
    sealed = item.get("encrypted_content")
    if open_reasoning is None or not isinstance(sealed, str) or not sealed:
        return None
    return open_reasoning(sealed)


# -- input items -----------------------------------------------------------------------


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest(f"'{where}' must be an object.", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(
                f"Invalid value for '{where}.role': expected one of user, system, developer, "
                "assistant.",
                param=f"{where}.role",
            )
        content = item.get("content")
        if not isinstance(content, str):
            if not isinstance(content, list):
                raise InvalidRequest(
                    f"'{where}.content' must be a string or an array of parts.",
                    param=f"{where}.content",
                )
            for j, part in enumerate(content):
                _part(part, f"{where}.content[{j}]")
        return {**item, "type": "message"}
    if kind in ("function_call", "custom_tool_call"):
        fields = ("call_id", "name", "arguments" if kind == "function_call" else "input")
        for name in fields:
            if not isinstance(item.get(name), str):
                raise InvalidRequest(f"'{where}.{name}' must be a string.", param=f"{where}.{name}")
        if item.get("namespace") is not None and not isinstance(item["namespace"], str):
            raise InvalidRequest(
                f"'{where}.namespace' must be a string.", param=f"{where}.namespace"
            )
        return dict(item)
    if kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"'{where}.call_id' must be a string.", param=f"{where}.call_id")
        if not isinstance(item.get("output"), str | list):
            raise InvalidRequest(
                f"'{where}.output' must be a string or an array of parts.", param=f"{where}.output"
            )
        return dict(item)
    if kind in COMPACTION_TYPES:
        return _compaction(item, where)
    if kind == "reasoning" or kind in SKIPPED_ITEMS:
        return dict(item)  # kept in the conversation; what the model is shown: chat_body
    raise InvalidRequest(
        f"Input items of type '{kind}' are not supported by this server (supported: message, "
        "function_call, function_call_output, custom_tool_call, custom_tool_call_output, "
        "reasoning, and compaction and hosted tools' items, which are skipped).",
        param=f"{where}.type",
    )


def _compaction(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``compaction`` item (``/v1/responses/compact``'s): its summary becomes context
    (``compaction_context``); one from elsewhere is kept in the conversation, unread."""
    if not isinstance(item.get("encrypted_content"), str):
        raise InvalidRequest(
            f"'{where}.encrypted_content' must be a string.", param=f"{where}.encrypted_content"
        )
    return dict(item)


def _part(part: Any, where: str) -> None:
    if not isinstance(part, dict):
        raise InvalidRequest(f"'{where}' must be an object.", param=where)
    kind = part.get("type")
    if isinstance(kind, str) and kind in TEXT_PARTS:
        if not isinstance(part.get("text", part.get("refusal")), str):
            raise InvalidRequest(f"'{where}.text' must be a string.", param=f"{where}.text")
        return
    if kind == "input_image":
        if not isinstance(part.get("image_url"), str):
            raise InvalidRequest(
                f"'{where}.image_url' is required: this server cannot read images by file_id.",
                param=f"{where}.image_url",
            )
        return
    raise InvalidRequest(
        f"Content parts of type '{kind}' are not supported by this server "
        "(supported: input_text, output_text, input_image with an image_url).",
        param=f"{where}.type",
    )


def _append_message(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> bool:
    """Appends (or extends) the chat message ``item`` makes; False for an item the model
    is not shown (a compaction, a hosted tool's call)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = "system" if item["role"] == "developer" else item["role"]
        content = _chat_content(item["content"])
        if role == "assistant" and not isinstance(content, str):
            content = _text_of(item["content"])
        messages.append({"role": role, "content": content})
    elif kind in ("function_call", "custom_tool_call"):
        if kind == "function_call":
            name, arguments = flat_name(item["name"], item.get("namespace")), item["arguments"]
        else:
            name, arguments = item["name"], custom_arguments(item["input"])
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one turn: its text, then its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item["output"]
        text = output if isinstance(output, str) else _text_of(output)
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    elif kind in COMPACTION_TYPES:
        summary = compaction_context(item)
        if summary is None:
            return False  # another server's compaction: nothing this pool can read
        messages.append(summary)
    else:
        return False
    return True


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A string when every part is text (what every adapter takes), else chat parts."""
    if isinstance(content, str):
        return content
    if all(part.get("type") in TEXT_PARTS for part in content):
        return _text_of(content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.get("type") == "input_image":
            image = {"url": part["image_url"]}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _part_text(part)})
    return parts


def _text_of(parts: Sequence[Any]) -> str:
    return "\n".join(_part_text(p) for p in parts if isinstance(p, dict) and _part_text(p))


def _part_text(part: Mapping[str, Any]) -> str:
    text = part.get("text", part.get("refusal", ""))
    return text if isinstance(text, str) else ""


# -- formats -------------------------------------------------------------------------


def _text(value: Any) -> dict[str, Any]:
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise InvalidRequest("'text' must be an object.", param="text")
    form = value.get("format", {"type": "text"})
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_schema", "json_object"):
        raise InvalidRequest(
            "'text.format.type' must be text, json_schema or json_object.", param="text.format"
        )
    if form["type"] == "json_schema" and not (
        isinstance(form.get("name"), str) and isinstance(form.get("schema"), dict)
    ):
        raise InvalidRequest(
            "'text.format' of type json_schema needs a 'name' and a 'schema' object.",
            param="text.format",
        )
    return {**value, "format": form}


def _response_format(form: Any) -> dict[str, Any] | None:
    if not isinstance(form, dict) or form.get("type") == "text":
        return None
    if form["type"] == "json_object":
        return {"type": "json_object"}
    schema: dict[str, Any] = {"name": form["name"], "schema": form["schema"]}
    for name in ("description", "strict"):
        if form.get(name) is not None:
            schema[name] = form[name]
    return {"type": "json_schema", "json_schema": schema}


# -- scalars -------------------------------------------------------------------------------


def _optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        names = {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}
        raise InvalidRequest(f"'{name}' must be {names[kind]}.", param=name)
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{name}' must be a number.", param=name)
    return value


def _count(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"'{name}' must be a non-negative integer.", param=name)
    return value


def _strings(body: Mapping[str, Any], name: str) -> list[str]:
    value = _optional(body, name, list) or []
    if not all(isinstance(entry, str) for entry in value):
        raise InvalidRequest(f"'{name}' must be an array of strings.", param=name)
    return list(value)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} string values.",
            param="metadata",
        )
    return dict(value)
