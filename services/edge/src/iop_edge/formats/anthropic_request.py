"""An Anthropic Messages request as the OpenAI chat-completions body every node adapter takes.

Pure: a body in, a chat body out, or ``InvalidRequest`` naming the field (as
Anthropic's ``invalid_request_error`` does). What the translation does, field
by field (docs/ARCHITECTURE.md#messages-api):

- ``system`` (a string or text blocks) becomes the first, ``system`` message, less
  Claude Code's ``x-anthropic-billing-header`` block (``BILLING_HEADER``): it changes
  on every request and would end every engine's prefix cache at its first tokens.
- ``system`` messages inside ``messages`` (Anthropic's mid-conversation system beta):
  those before any turn join the leading system message; a later one becomes text
  between ``<system>`` tags in the user turn beside it (appended to the user turn it
  follows, else put before the next one, else a user turn of its own). Chat templates
  (llama.cpp's Jinja ones, vLLM's, Ollama's) often refuse a system message past the
  first position or move it to the front, and moving it would change the prompt's
  prefix, so the engine's cache, each time one is added.
- ``messages``: text blocks become text parts; ``image`` blocks (base64 or URL
  sources) become ``image_url`` parts, base64 as ``data:`` URLs; an assistant's
  ``tool_use`` blocks become its ``tool_calls`` (``input`` written as the
  arguments JSON); a user's ``tool_result`` blocks become ``tool`` messages, put
  first (chat wants them right after the assistant turn that called), an
  ``is_error`` result prefixed ``Error:`` (chat has no such flag). ``thinking``
  blocks sent back are dropped: chat models take no reasoning as input.
- ``tools`` become function tools (``input_schema`` is the parameters schema).
  Anthropic's client tools that carry no schema (``bash_*``, ``text_editor_*``: the
  client runs them) are offered with the input schema Anthropic documents for them.
  Every other typed tool (web search and fetch, code execution, computer use, tool
  search, MCP ...) is run by Anthropic's servers, which are not here: it is left out
  of what the model is offered, and ``dropped_tools`` names it (the answer's
  ``x-iop-dropped-tools`` header). ``tool_choice`` ``auto``/``any``/``tool``/``none``
  become ``auto``/``required``/the named function/``none``, and
  ``disable_parallel_tool_use`` becomes ``parallel_tool_calls: false``.
- ``max_tokens`` is required; ``stop_sequences`` become ``stop``; ``temperature``,
  ``top_p`` and ``top_k`` pass as they are.
- ``thinking`` (``enabled`` with ``budget_tokens``) and ``output_config.effort``
  become ``reasoning_effort``, the chat API's reasoning control; a JSON
  ``output_config.format`` becomes a ``json_schema`` ``response_format``.
- ``metadata`` and the Claude-only fields (``service_tier``, ``container``,
  ``context_management``, ``cache_control`` on blocks ...) are accepted and not
  forwarded: no provider here has a use for them, and some refuse unknown fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from iop_edge.errors import InvalidRequest
from iop_proto import json_codec

PASSED_SAMPLING: Final = ("temperature", "top_p", "top_k")
PASSED_THROUGH: Final = ("iop_mock",)
"""IOP's own request hooks (the mock provider's failure drills) travel as in chat."""
EFFORT_BUDGETS: Final = ((4096, "low"), (16384, "medium"))
"""``budget_tokens`` up to these become that effort; above, ``high``. Claude Code's
"think" / "think hard" / "ultrathink" budgets (4000, 10000, 31999) land on the three."""
EFFORTS: Final = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
CUSTOM_TOOL_TYPES: Final = (None, "custom")
BILLING_HEADER: Final = "x-anthropic-billing-header:"
"""The first system block Claude Code sends (``cc_version=...; cc_entrypoint=...;
cch=...;``): billing data for Anthropic, a hash that differs on every request."""
SYSTEM_NOTE: Final = "<system>\n{}\n</system>"
"""How a system message past the first turn reads inside a user turn."""
SKIPPED_ASSISTANT_BLOCKS: Final = frozenset(
    {"thinking", "redacted_thinking", "server_tool_use", "mcp_tool_use"}
)
"""Assistant blocks dropped from the history: reasoning (chat models take none as input)
and calls of server tools, which ran at Anthropic (their ``*_tool_result`` too)."""
BASH_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the bash session."},
    },
}
EDITOR_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "command": {
            "type": "string",
            "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
        },
        "path": {"type": "string", "description": "Absolute path of the file or directory."},
        "file_text": {"type": "string", "description": "create: the file's content."},
        "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
        "new_str": {"type": "string", "description": "str_replace, insert: the new text."},
        "insert_line": {"type": "integer", "description": "insert: the line to insert after."},
        "view_range": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "view: the first and last line to show.",
        },
    },
    "required": ["command", "path"],
}
SCHEMALESS_CLIENT_TOOLS: Final = (
    ("bash_", BASH_SCHEMA, "Run a command in a persistent bash shell."),
    ("text_editor_", EDITOR_SCHEMA, "View, create and edit files."),
)
"""Anthropic's client tools (run by the client, which sends no schema: Claude knows
them), by type prefix: offered as function tools with the input Anthropic documents."""
TOOL_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}
ERROR_PREFIX: Final = "Error: "


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body of a ``POST /v1/messages`` body.

    A ``max_tokens`` above the model's ``max_output_tokens`` is lowered to it by the
    pipeline, as on every API (``service.limits.bound_answer``): Anthropic
    clients size it for Claude, not for the pool's model.
    """
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int:
        raise InvalidRequest("max_tokens: Field required (an integer).", param="max_tokens")
    if max_tokens < 1:
        raise InvalidRequest("max_tokens: must be greater than or equal to 1.", param="max_tokens")
    chat = prompt_body(body)
    chat["max_tokens"] = max_tokens
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop_sequences: must be an array of strings.", param="stop")
        if stop:
            chat["stop"] = stop
    for field in PASSED_SAMPLING:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{field}: must be a number.", param=field)
        chat[field] = value
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest("metadata: must be an object.", param="metadata")
    for field in PASSED_THROUGH:
        if field in body:
            chat[field] = body[field]
    if stream_asked(body):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the usage message_delta reports
    return chat


def prompt_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a request and its ``count_tokens`` share: model, system, messages, tools,
    tool choice and the reasoning controls."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: Field required (a string).", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: must be a non-empty array.", param="messages")
    chat: dict[str, Any] = {"model": model, "messages": _conversation(body, messages)}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat.update(_tool_choice(body.get("tool_choice"), {t["function"]["name"] for t in tools}))
    effort = _effort(body.get("thinking"), body.get("output_config"))
    if effort:
        chat["reasoning_effort"] = effort
    answer_format = _response_format(body.get("output_config"))
    if answer_format is not None:
        chat["response_format"] = answer_format
    return chat


def stream_asked(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream: must be a boolean.", param="stream")
    return bool(stream)


def _conversation(body: Mapping[str, Any], messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages: the system texts first, then the turns, each system message
    past the first turn as a note in a user turn (see the module's docstring)."""
    system = _system_texts(body.get("system"), "system", "system")
    turns: list[dict[str, Any]] = []
    pending: list[str] = []  # notes waiting for the next user turn
    for position, message in enumerate(messages):
        where = f"messages.{position}"
        if isinstance(message, dict) and message.get("role") == "system":
            if message.get("content") is None:
                raise InvalidRequest(f"{where}.content: Field required.", param=where)
            texts = _system_texts(message["content"], f"{where}.content", where)
            if not turns:
                system.extend(texts)
            elif turns[-1]["role"] == "user":
                _add_notes(turns[-1], texts, at_end=True)
            else:
                pending.extend(texts)
            continue
        for turn in _message(message, where):
            if pending and turn["role"] == "user":
                _add_notes(turn, pending, at_end=False)
                pending = []
            elif pending and turn["role"] == "assistant":
                turns.append(_note_turn(pending))
                pending = []
            turns.append(turn)
    if pending:
        turns.append(_note_turn(pending))
    if not turns:
        raise InvalidRequest("messages: must hold a user or assistant message.", param="messages")
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + turns


def _system_texts(system: Any, where: str, param: str) -> list[str]:
    """The texts of a ``system`` field or message, without Claude Code's billing header."""
    if system is None or system == "":
        return []
    if isinstance(system, str):
        if system.startswith(BILLING_HEADER):
            system = system.partition("\n")[2].lstrip("\n")
        return [system] if system else []
    if isinstance(system, list):
        texts = [_text_of(block, f"{where}.{i}") for i, block in enumerate(system)]
        return [text for text in texts if not text.startswith(BILLING_HEADER)]
    raise InvalidRequest(f"{where}: must be a string or an array of text blocks.", param=param)


def _add_notes(turn: dict[str, Any], texts: list[str], *, at_end: bool) -> None:
    """System texts into a user turn, as text parts before or after its own."""
    content = turn["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    notes = [{"type": "text", "text": SYSTEM_NOTE.format(text)} for text in texts]
    turn["content"] = parts + notes if at_end else notes + parts


def _note_turn(texts: list[str]) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": SYSTEM_NOTE.format(t)} for t in texts],
    }


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise InvalidRequest(f"{where}: must be a text block.", param=where)
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text: Field required (a string).", param=where)
    return text


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as one or more chat messages (tool results split off)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidRequest(
            f"{where}: must be an object with role user or assistant.", param=where
        )
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or an array.", param=where)
    if message["role"] == "assistant":
        return [_assistant(content, where)]
    return _user(content, where)


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{i}"
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind in SKIPPED_ASSISTANT_BLOCKS or _server_tool_result(kind):
            continue
        else:
            raise InvalidRequest(f"{at}: an assistant block of type {kind!r} is not supported.")
    # null content only beside tool calls: servers refuse an assistant turn with neither
    content = "".join(texts)
    out: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}: a tool_use block needs an id and a name.", param=where)
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.input: must be an object.", param=where)
    encoded = json_codec.dumps(arguments).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": encoded}}


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{i}"
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            tool_message, images = _tool_result(block, at)
            results.append(tool_message)
            parts.extend(images)  # chat's tool messages take text only: images follow
        elif kind == "document" and _text_source(block):
            parts.append({"type": "text", "text": block["source"]["data"]})
        elif _server_tool_result(kind):
            continue
        else:
            raise InvalidRequest(f"{at}: a user block of type {kind!r} is not supported.")
    if parts:
        results.append({"role": "user", "content": parts})
    return results


def _server_tool_result(kind: Any) -> bool:
    """A server tool's result block (``web_search_tool_result``, ``mcp_tool_result`` ...):
    a client tool's result is ``tool_result`` itself."""
    return isinstance(kind, str) and kind.endswith("_tool_result")


def _text_source(block: dict[str, Any]) -> bool:
    source = block.get("source")
    return isinstance(source, dict) and source.get("type") == "text" and "data" in source


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise InvalidRequest(f"{where}.source: needs media_type and data.", param=where)
        url = f"data:{media};base64,{data}"
    elif kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise InvalidRequest(f"{where}.source: only base64 and url images are supported.")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{where}.tool_use_id: Field required.", param=where)
    content = block.get("content", "")
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                images.append(_image(part, f"{where}.content.{i}"))
            else:
                texts.append(_text_of(part, f"{where}.content.{i}"))
        text = "\n".join(texts)
    else:
        raise InvalidRequest(f"{where}.content: must be a string or an array.", param=where)
    if block.get("is_error") is True:
        text = ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}, images


def _tools(tools: Any) -> list[dict[str, Any]]:
    converted = []
    for where, tool in _tool_list(tools):
        kind = tool.get("type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            if kind in CUSTOM_TOOL_TYPES or _client_tool(kind):
                raise InvalidRequest(f"{where}.name: Field required.", param=where)
            continue
        client = _client_tool(kind)
        if client is not None:
            documented, description = client
            function = {"name": name, "description": description, "parameters": documented}
            converted.append({"type": "function", "function": function})
            continue
        if kind not in CUSTOM_TOOL_TYPES:
            continue  # a server tool: dropped_tools names it
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where}.input_schema: Field required (an object).", param=where)
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def dropped_tools(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The types of the request's server tools, which the model is not offered: each
    once, in the order the request lists them."""
    dropped: dict[str, None] = {}
    for _, tool in _tool_list(body.get("tools")):
        kind = tool.get("type")
        if kind not in CUSTOM_TOOL_TYPES and _client_tool(kind) is None:
            dropped[str(kind)] = None
    return tuple(dropped)


def _tool_list(tools: Any) -> list[tuple[str, dict[str, Any]]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be an array.", param="tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools.{i}: must be an object.", param=f"tools.{i}")
    return [(f"tools.{i}", tool) for i, tool in enumerate(tools)]


def _client_tool(kind: Any) -> tuple[dict[str, Any], str] | None:
    """The schema and description of an Anthropic client tool type, ``None`` for others."""
    if not isinstance(kind, str):
        return None
    for prefix, schema, description in SCHEMALESS_CLIENT_TOOLS:
        if kind.startswith(prefix):
            return schema, description
    return None


def _tool_choice(choice: Any, names: set[str]) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or kind not in (*TOOL_CHOICES, "tool"):
        raise InvalidRequest(
            "tool_choice: must be an object of type auto, any, tool or none.", param="tool_choice"
        )
    out: dict[str, Any] = {}
    if kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise InvalidRequest(
                f"tool_choice.name: no tool offered to the model is named {name!r} "
                "(server tools are not offered here).",
                param="tool_choice",
            )
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = TOOL_CHOICES[kind]
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        out["parallel_tool_calls"] = False
    return out


def _effort(thinking: Any, output_config: Any) -> str | None:
    """The chat ``reasoning_effort`` the request asks for, if any."""
    if isinstance(output_config, dict) and output_config.get("effort") is not None:
        effort = EFFORTS.get(output_config["effort"])
        if effort is None:
            raise InvalidRequest(
                f"output_config.effort: must be one of {', '.join(EFFORTS)}.", param="output_config"
            )
        return effort
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("disabled", "adaptive"):
        return None  # adaptive: the model's own default
    if kind != "enabled" or not isinstance(thinking, dict):
        raise InvalidRequest(
            "thinking: type must be enabled, adaptive or disabled.", param="thinking"
        )
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise InvalidRequest(
            "thinking.budget_tokens: Field required (a positive integer).", param="thinking"
        )
    return next((effort for limit, effort in EFFORT_BUDGETS if budget <= limit), "high")


def _response_format(output_config: Any) -> dict[str, Any] | None:
    if output_config is None:
        return None
    if not isinstance(output_config, dict):
        raise InvalidRequest("output_config: must be an object.", param="output_config")
    answer_format = output_config.get("format")
    if answer_format is None:
        return None
    if not isinstance(answer_format, dict) or answer_format.get("type") != "json_schema":
        raise InvalidRequest(
            "output_config.format: type must be json_schema.", param="output_config"
        )
    schema = answer_format.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "output_config.format.schema: must be an object.", param="output_config"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def estimate_tokens(chat: Mapping[str, Any]) -> int:
    """A rough input size when a provider reports no usage: about four bytes of UTF-8
    a token, over the messages and tools as JSON (``count_tokens`` says so)."""
    size = len(json_codec.dumps([chat.get("messages"), chat.get("tools")]))
    return max(1, (size + 3) // 4)
