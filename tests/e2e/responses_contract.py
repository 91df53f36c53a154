"""The Open Responses specification's contract, checked on real answers.

Written here, in our own words, from the specification's published schema (spec version
2026-04-24: github.com/openresponses/openresponses, ``schema/*.tsp`` and the
``components/schemas`` JSON): the fields each object and each streamed event requires,
and their types. ``None`` in a type tuple: the schema allows ``null`` there. A field the
schema marks optional but types without ``null`` (a reasoning item's
``encrypted_content``) must be absent rather than ``null``.

Outside the specification, and checked as OpenAI sends them: the ``custom_tool_call``
item and its ``response.custom_tool_call_input.*`` events (custom tools are an OpenAI
extension the specification does not define yet).
"""

from __future__ import annotations

from typing import Any

Types = tuple[type | None, ...]
INT: Types = (int,)
NUM: Types = (int, float)
STR: Types = (str,)

RESPONSE: dict[str, Types] = {
    "id": STR,
    "object": STR,
    "created_at": INT,
    "completed_at": (int, None),
    "status": STR,
    "incomplete_details": (dict, None),
    "model": STR,
    "previous_response_id": (str, None),
    "instructions": (str, list, None),
    "output": (list,),
    "error": (dict, None),
    "tools": (list,),
    "tool_choice": (str, dict),
    "truncation": STR,
    "parallel_tool_calls": (bool,),
    "text": (dict,),
    "top_p": NUM,
    "presence_penalty": NUM,
    "frequency_penalty": NUM,
    "top_logprobs": INT,
    "temperature": NUM,
    "reasoning": (dict, None),
    "user": (str, None),
    "usage": (dict, None),
    "max_output_tokens": (int, None),
    "max_tool_calls": (int, None),
    "store": (bool,),
    "background": (bool,),
    "service_tier": STR,
    "metadata": (dict,),
    "safety_identifier": (str, None),
    "prompt_cache_key": (str, None),
}
"""ResponseResource: every field is required."""
USAGE: dict[str, Types] = {
    "input_tokens": INT,
    "output_tokens": INT,
    "total_tokens": INT,
    "input_tokens_details": (dict,),
    "output_tokens_details": (dict,),
}
ERROR: dict[str, Types] = {"code": STR, "message": STR}
ITEMS: dict[str, dict[str, Types]] = {
    "message": {"type": STR, "id": STR, "status": STR, "role": STR, "content": (list,)},
    "function_call": {
        "type": STR,
        "id": STR,
        "call_id": STR,
        "name": STR,
        "arguments": STR,
        "status": STR,
    },
    "function_call_output": {
        "type": STR,
        "id": STR,
        "call_id": STR,
        "output": (str, list),
        "status": STR,
    },
    "reasoning": {"type": STR, "id": STR, "summary": (list,)},
    "compaction": {"type": STR, "id": STR, "encrypted_content": STR},
    # OpenAI's, not (yet) the specification's:
    "custom_tool_call": {"type": STR, "id": STR, "call_id": STR, "name": STR, "input": STR},
}
"""ItemField, by type."""
ITEM_STATUSES = {"in_progress", "completed", "incomplete"}
PARTS: dict[str, dict[str, Types]] = {
    "output_text": {"type": STR, "text": STR, "annotations": (list,)},
    "reasoning_text": {"type": STR, "text": STR},
    "summary_text": {"type": STR, "text": STR},
    "refusal": {"type": STR, "refusal": STR},
}
_AT: dict[str, Types] = {"item_id": STR, "output_index": INT}
_PART_AT: dict[str, Types] = {**_AT, "content_index": INT}
_SUMMARY_AT: dict[str, Types] = {**_AT, "summary_index": INT}
EVENTS: dict[str, dict[str, Types]] = {
    **{
        f"response.{name}": {"response": (dict,)}
        for name in ("created", "queued", "in_progress", "completed", "failed", "incomplete")
    },
    "response.output_item.added": {"output_index": INT, "item": (dict, None)},
    "response.output_item.done": {"output_index": INT, "item": (dict, None)},
    "response.content_part.added": {**_PART_AT, "part": (dict,)},
    "response.content_part.done": {**_PART_AT, "part": (dict,)},
    "response.output_text.delta": {**_PART_AT, "delta": STR},
    "response.output_text.done": {**_PART_AT, "text": STR},
    "response.refusal.delta": {**_PART_AT, "delta": STR},
    "response.refusal.done": {**_PART_AT, "refusal": STR},
    "response.reasoning_text.delta": {**_PART_AT, "delta": STR},
    "response.reasoning_text.done": {**_PART_AT, "text": STR},
    "response.reasoning_summary_part.added": {**_SUMMARY_AT, "part": (dict,)},
    "response.reasoning_summary_part.done": {**_SUMMARY_AT, "part": (dict,)},
    "response.reasoning_summary_text.delta": {**_SUMMARY_AT, "delta": STR},
    "response.reasoning_summary_text.done": {**_SUMMARY_AT, "text": STR},
    "response.output_text.annotation.added": {
        **_PART_AT,
        "annotation_index": INT,
        "annotation": (dict, None),
    },
    "response.function_call_arguments.delta": {**_AT, "delta": STR},
    "response.function_call_arguments.done": {**_AT, "arguments": STR},
    "error": {"error": (dict,)},
    # OpenAI's, not (yet) the specification's:
    "response.custom_tool_call_input.delta": {**_AT, "delta": STR},
    "response.custom_tool_call_input.done": {**_AT, "input": STR},
}
"""Every streamed event, by type; each also requires ``type`` and an integer
``sequence_number``."""
ERROR_PAYLOAD: dict[str, Types] = {
    "type": STR,
    "code": (str, None),
    "message": STR,
    "param": (str, None),
}
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def has(obj: Any, fields: dict[str, Types], where: str) -> None:
    """``obj`` has each of ``fields``, of one of its types."""
    assert isinstance(obj, dict), f"{where}: expected an object, got {obj!r}"
    for name, kinds in fields.items():
        assert name in obj, f"{where}: '{name}' is required: {sorted(obj)}"
        value = obj[name]
        if value is None:
            assert None in kinds, f"{where}.{name} may not be null"
            continue
        types = tuple(kind for kind in kinds if kind is not None)
        assert isinstance(value, types), f"{where}.{name}: expected {types}, got {value!r}"
        if bool not in types:
            assert not isinstance(value, bool), f"{where}.{name}: a boolean is not {types}"


def check_response(response: Any, where: str = "response") -> None:
    has(response, RESPONSE, where)
    assert response["object"] == "response"
    status = response["status"]
    assert (response["completed_at"] is not None) == (status == "completed"), (
        f"{where}: completed_at is set exactly when the status is completed"
    )
    if response["error"] is not None:
        has(response["error"], ERROR, f"{where}.error")
    if response["incomplete_details"] is not None:
        has(response["incomplete_details"], {"reason": STR}, f"{where}.incomplete_details")
    if response["usage"] is not None:
        usage = response["usage"]
        has(usage, USAGE, f"{where}.usage")
        has(usage["input_tokens_details"], {"cached_tokens": INT}, f"{where}.usage.input")
        has(usage["output_tokens_details"], {"reasoning_tokens": INT}, f"{where}.usage.output")
    for index, item in enumerate(response["output"]):
        check_item(item, f"{where}.output[{index}]")


def check_item(item: Any, where: str = "item") -> None:
    assert isinstance(item, dict), where
    kind = item.get("type")
    assert kind in ITEMS, f"{where}: no item of type {kind!r} in the contract"
    has(item, ITEMS[kind], where)
    if "status" in item:
        assert item["status"] in ITEM_STATUSES, f"{where}.status: {item['status']!r}"
    if kind == "reasoning":
        if "encrypted_content" in item:
            has(item, {"encrypted_content": STR}, where)
        for j, part in enumerate([*item.get("content", ()), *item["summary"]]):
            check_part(part, f"{where}.parts[{j}]")
    if kind == "message":
        for j, part in enumerate(item["content"]):
            check_part(part, f"{where}.content[{j}]")


def check_part(part: Any, where: str) -> None:
    assert isinstance(part, dict), where
    kind = part.get("type")
    assert kind in PARTS, f"{where}: no part of type {kind!r} in the contract"
    has(part, PARTS[kind], where)


def check_events(events: list[dict[str, Any]]) -> None:
    """A stream's events: each with what its type requires, numbered from 0 in order,
    opened by ``response.created`` and ended by one terminal event."""
    assert events, "no events"
    for index, event in enumerate(events):
        where = f"event[{index}] {event.get('type')}"
        has(event, {"type": STR, "sequence_number": INT}, where)
        assert event["sequence_number"] == index, f"{where}: out of sequence"
        kind = event["type"]
        assert kind in EVENTS, f"{where}: no event of this type in the contract"
        has(event, EVENTS[kind], where)
        if "response" in event:
            check_response(event["response"], f"{where}.response")
        if event.get("item") is not None:
            check_item(event["item"], f"{where}.item")
        if event.get("part") is not None:
            check_part(event["part"], f"{where}.part")
        if kind == "error":
            has(event["error"], ERROR_PAYLOAD, f"{where}.error")
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in TERMINAL
    assert not any(e["type"] in TERMINAL for e in events[:-1]), "one terminal event, last"
