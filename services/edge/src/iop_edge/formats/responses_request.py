"""An OpenAI Responses request read, checked, and written as a chat-completions body.

Every node adapter takes the chat-completions shape, so a Responses request
runs as a chat completion: ``instructions`` and the input items (with those of
a ``previous_response_id`` chain in front) become ``messages``, function tools
become chat tools, ``max_output_tokens`` becomes ``max_tokens`` (held to the
model's cap by the dispatcher like chat's own), ``text.format`` becomes
``response_format``, ``reasoning.effort`` becomes ``reasoning_effort``. What
only the Responses object carries (``store``, ``include``, ``metadata``,
``truncation``) stays here, to be echoed in the answer. Pure: no I/O, so every
rule is tested on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.errors import InvalidRequest
from iop_edge.formats.responses_compaction import COMPACTION_TYPES, compaction_context

ROLES: Final = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text", "summary_text", "refusal"})
TOOL_CHOICES: Final = frozenset({"auto", "none", "required"})
REFUSED_FIELDS: Final = {
    "background": "Background responses are not supported by this server.",
    "conversation": "Conversations are not supported by this server; use previous_response_id.",
    "prompt": "Prompt templates are not supported by this server.",
}
"""Fields whose meaning this server cannot honour: refused (400) rather than ignored."""
MAX_METADATA_PAIRS: Final = 16


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """What a Responses request asks for, checked; ``items`` are this request's own input."""

    model: str
    stream: bool
    store: bool
    items: list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    include: list[str] = field(default_factory=list)
    truncation: str = "disabled"
    user: str | None = None

    @property
    def echo(self) -> dict[str, Any]:
        """The request's settings as the Response object repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
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
            "tools": self.tools,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": self.truncation,
            "user": self.user,
            "background": False,
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
    tools = [_tool(tool, i) for i, tool in enumerate(_optional(body, "tools", list) or [])]
    return ResponsesRequest(
        model=model,
        stream=bool(_optional(body, "stream", bool)),
        store=_optional(body, "store", bool) is not False,
        items=items,
        instructions=_optional(body, "instructions", str),
        previous_response_id=previous,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_optional(body, "parallel_tool_calls", bool) is not False,
        max_output_tokens=body.get("max_output_tokens"),  # the dispatcher checks it (limits)
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        text=_text(body.get("text")),
        reasoning=_optional(body, "reasoning", dict) or {},
        metadata=_metadata(body.get("metadata")),
        include=_strings(body, "include"),
        truncation=_optional(body, "truncation", str) or "disabled",
        user=_optional(body, "user", str),
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


def chat_body(request: ResponsesRequest, history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The chat-completions body that runs ``request`` after ``history`` (the items of
    its ``previous_response_id`` chain, oldest first)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    for item in (*history, *request.items):
        _append_message(messages, item)
    if not messages:
        raise InvalidRequest("The request has no input to answer.", param="input")
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if request.tools:
        chat["tools"] = [_chat_tool(tool) for tool in request.tools]
        chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
        chat["parallel_tool_calls"] = request.parallel_tool_calls
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    if request.temperature is not None:
        chat["temperature"] = request.temperature
    if request.top_p is not None:
        chat["top_p"] = request.top_p
    response_format = _response_format(request.text.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = request.reasoning.get("effort")
    if isinstance(effort, str):
        chat["reasoning_effort"] = effort
    if request.user:
        chat["user"] = request.user
    return chat


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
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise InvalidRequest(f"'{where}.{name}' must be a string.", param=f"{where}.{name}")
        return dict(item)
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"'{where}.call_id' must be a string.", param=f"{where}.call_id")
        if not isinstance(item.get("output"), str | list):
            raise InvalidRequest(
                f"'{where}.output' must be a string or an array of parts.", param=f"{where}.output"
            )
        return dict(item)
    if kind == "reasoning":
        return dict(item)  # kept in the conversation; a provider is not shown another's
    if kind in COMPACTION_TYPES:
        return _compaction(item, where)
    raise InvalidRequest(
        f"Input items of type '{kind}' are not supported by this server (supported: message, "
        "function_call, function_call_output, reasoning, compaction).",
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


def _append_message(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = "system" if item["role"] == "developer" else item["role"]
        content = _chat_content(item["content"])
        if role == "assistant" and not isinstance(content, str):
            content = _text_of(item["content"])
        messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one turn: its text, then its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item["output"]
        text = output if isinstance(output, str) else _text_of(output)
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    elif kind in COMPACTION_TYPES:
        summary = compaction_context(item)
        if summary is not None:
            messages.append(summary)
    # reasoning items: the provider's own thoughts are not replayed to it


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


# -- tools and formats -------------------------------------------------------------------


def _tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise InvalidRequest(f"'{where}' must be an object.", param=where)
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequest(
            f"Tools of type '{kind}' are not supported by this server: only function tools "
            "are (the models run on this fleet's own providers).",
            param=f"{where}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required.", param=f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(
            f"'{where}.parameters' must be an object.", param=f"{where}.parameters"
        )
    return {
        "type": "function",
        "name": name,
        "description": tool.get("description"),
        "parameters": parameters,
        "strict": tool.get("strict") if isinstance(tool.get("strict"), bool) else True,
    }


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
    function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(value: Any, tools: Sequence[Mapping[str, Any]]) -> Any:
    if value is None:
        return "auto"
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not any(tool["name"] == name for tool in tools):
            raise InvalidRequest(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'.",
                param="tool_choice",
            )
        return {"type": "function", "name": name}
    raise InvalidRequest(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "name": ...}.',
        param="tool_choice",
    )


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


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
