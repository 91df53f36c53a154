"""OpenAI request bodies as Ollama native payloads (``/api/chat``, ``/generate``, ``/embed``).

Pure functions, kept apart from the adapter's I/O because most of the
translation's judgement sits here and it is easiest to read (and test) alone. What
Ollama cannot express is refused with ``InvalidRequest`` rather than dropped:
a client that asks for two choices or a remote image must hear that it will not
get them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from iop_node.domain.runs import ExecutionSpec
from iop_node.errors import InvalidRequest

OUTPUT_LENGTH_FIELDS: Final = ("max_completion_tokens", "max_tokens")
"""What becomes ``options.num_predict`` (the first given wins): each capped by the edge."""
PASSED_OPTIONS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
"""OpenAI sampling parameters that keep their name as Ollama ``options``."""

ROLES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system role; Ollama knows only the old
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def chat_payload(spec: ExecutionSpec) -> dict[str, Any]:
    """``/api/chat``: messages converted, sampling parameters moved into ``options``."""
    body = spec.body
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    payload = _common(spec)
    payload["messages"] = _messages(messages)
    tools = body.get("tools")
    if tools and body.get("tool_choice") != "none":  # Ollama has no tool_choice: "none" = no tools
        if not isinstance(tools, list):
            raise InvalidRequest("tools must be a list")
        payload["tools"] = tools  # Ollama takes OpenAI's tool definitions as they are
    return payload


def generate_payload(spec: ExecutionSpec) -> dict[str, Any]:
    """``/api/generate`` for a legacy completion: one prompt (Ollama answers one at a time)."""
    prompt = spec.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be one string (ollama takes no batches or token ids)")
    payload = _common(spec)
    payload["prompt"] = prompt
    suffix = spec.body.get("suffix")
    if suffix is not None:
        payload["suffix"] = str(suffix)
    return payload


def embed_payload(spec: ExecutionSpec) -> dict[str, Any]:
    """``/api/embed``: a string or a list of strings; token-id inputs cannot be embedded."""
    body = spec.body
    items = body.get("input")
    if not (
        isinstance(items, str)
        or (isinstance(items, list) and items and all(isinstance(i, str) for i in items))
    ):
        raise InvalidRequest("input must be a string or a non-empty list of strings")
    payload: dict[str, Any] = {"model": spec.target, "input": items}
    for key in ("dimensions", "keep_alive"):
        if body.get(key) is not None:
            payload[key] = body[key]
    return payload


def _common(spec: ExecutionSpec) -> dict[str, Any]:
    """What chat and generate share: model, stream, options, format, keep_alive."""
    body = spec.body
    choices = body.get("n", 1)
    if choices not in (None, 1):
        raise InvalidRequest("n must be 1: ollama produces one choice per request")
    payload: dict[str, Any] = {"model": spec.target, "stream": spec.stream}
    payload["options"] = options(body)
    answer_format = response_format(body.get("response_format"))
    if answer_format is not None:
        payload["format"] = answer_format
    if body.get("keep_alive") is not None:
        payload["keep_alive"] = body["keep_alive"]
    return payload


def options(body: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama ``options`` from OpenAI parameters (only those the client set)."""
    result: dict[str, Any] = {}
    limit = next((body[f] for f in OUTPUT_LENGTH_FIELDS if body.get(f) is not None), None)
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidRequest("max_tokens must be a non-negative integer")
        result["num_predict"] = limit
    for key in PASSED_OPTIONS:
        if body.get(key) is not None:
            result[key] = body[key]
    stop = body.get("stop")
    if isinstance(stop, str):
        result["stop"] = [stop]
    elif isinstance(stop, list) and stop:
        result["stop"] = [str(s) for s in stop]
    return result


def response_format(value: Any) -> str | dict[str, Any] | None:
    """``json_object`` is Ollama's ``"json"``; a ``json_schema`` is passed as the schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be an object")
        return schema
    raise InvalidRequest("response_format.type must be text, json_object or json_schema")


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages as Ollama's; tool results get the name of the call they answer."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant turns
    converted: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise InvalidRequest(
                f"messages[{position}] must be an object with a role in {', '.join(ROLES)}"
            )
        role = ROLES[message["role"]]
        text, images = _content(message.get("content"), position)
        out: dict[str, Any] = {"role": role, "content": text}
        if images:
            out["images"] = images
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = _tool_calls(message["tool_calls"], position, names)
        if role == "tool":
            name = names.get(str(message.get("tool_call_id", "")))
            if name:
                out["tool_name"] = name
        converted.append(out)
    return converted


def _content(content: Any, position: int) -> tuple[str, list[str]]:
    """Text and base64 images of a message; text parts are joined with newlines."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{position}].content must be a string or a list of parts")
    texts: list[str] = []
    images: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url", "") if isinstance(image, Mapping) else image
            head, _, data = str(url).partition(";base64,")
            if not head.startswith("data:image/") or not data:
                raise InvalidRequest(
                    f"messages[{position}]: ollama takes images only as data:image/...;base64 URLs"
                )
            images.append(data)
        else:
            raise InvalidRequest(f"messages[{position}]: content part {kind!r} is not supported")
    return "\n".join(texts), images


def _tool_calls(calls: Any, position: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant turn's calls with object arguments (Ollama rejects OpenAI's JSON strings)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{position}].tool_calls must be a list")
    converted: list[dict[str, Any]] = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not function.get("name"):
            raise InvalidRequest(f"messages[{position}]: a tool call has no function name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise InvalidRequest(
                    f"messages[{position}]: tool call arguments are not valid JSON"
                ) from exc
        if call.get("id"):
            names[str(call["id"])] = str(function["name"])
        converted.append({"function": {"name": function["name"], "arguments": arguments}})
    return converted
