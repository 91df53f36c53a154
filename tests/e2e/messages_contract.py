"""Anthropic's Messages API contract, as its API reference states it, checked on real answers.

Encoded here from the reference (the Message object, its content blocks, the
streaming events and their order, the token count and the error object; read in
the published API reference and the SDK's generated types), in our own words:
required fields, their types, and the order of events. Nothing here is built by
hand to pass: every check runs on what the stack answered.
"""

from __future__ import annotations

import json
from typing import Any

STOP_REASONS = {
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
}
ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
}
BLOCK_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "text": {"text": str},
    "tool_use": {"id": str, "name": str, "input": dict},
    "thinking": {"thinking": str, "signature": str},
}
DELTA_FIELDS: dict[str, dict[str, type]] = {
    "text_delta": {"text": str},
    "input_json_delta": {"partial_json": str},
    "thinking_delta": {"thinking": str},
    "signature_delta": {"signature": str},
}
DELTA_FOR_BLOCK = {
    "text": {"text_delta"},
    "tool_use": {"input_json_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
}


def has(obj: dict[str, Any], fields: dict[str, type | tuple[type, ...]], where: str) -> None:
    for name, kind in fields.items():
        assert name in obj, f"{where}: '{name}' is required: {obj}"
        value = obj[name]
        assert isinstance(value, kind), f"{where}.{name}: expected {kind}, got {value!r}"
        assert not isinstance(value, bool), f"{where}.{name}: a boolean is not a {kind}"


def check_usage(usage: Any, where: str) -> None:
    assert isinstance(usage, dict), f"{where}: usage is required"
    has(usage, {"input_tokens": int, "output_tokens": int}, where)
    assert usage["input_tokens"] >= 0
    assert usage["output_tokens"] >= 0


def check_block(block: Any, where: str) -> None:
    assert isinstance(block, dict), where
    kind = block.get("type")
    assert kind in BLOCK_FIELDS, f"{where}: unknown block type {kind!r}"
    has(block, BLOCK_FIELDS[kind], where)


def check_message(message: Any, *, streaming_start: bool = False) -> None:
    """The Message object (``streaming_start``: as in ``message_start``, before any output)."""
    assert isinstance(message, dict)
    has(message, {"id": str, "type": str, "role": str, "model": str, "content": list}, "message")
    assert message["type"] == "message"
    assert message["role"] == "assistant"
    assert "stop_reason" in message
    assert "stop_sequence" in message
    assert message["stop_sequence"] is None or isinstance(message["stop_sequence"], str)
    check_usage(message.get("usage"), "message.usage")
    if streaming_start:
        assert message["stop_reason"] is None, "null in message_start"
        assert message["content"] == []
        return
    assert message["stop_reason"] in STOP_REASONS, "non-null in a non-streamed answer"
    for i, block in enumerate(message["content"]):
        check_block(block, f"message.content.{i}")
    if message["stop_reason"] == "tool_use":
        assert any(b["type"] == "tool_use" for b in message["content"])


def check_token_count(count: Any) -> None:
    assert isinstance(count, dict)
    has(count, {"input_tokens": int}, "count")
    assert count["input_tokens"] > 0


def check_error(body: Any) -> None:
    assert isinstance(body, dict)
    assert body.get("type") == "error", body
    error = body.get("error")
    assert isinstance(error, dict)
    has(error, {"type": str, "message": str}, "error")
    assert error["type"] in ERROR_TYPES


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``event:`` / ``data:`` pairs; every event of the Messages API has both."""
    events = []
    for raw in text.split("\n\n"):
        if not raw.strip():
            continue
        lines = dict(line.split(": ", 1) for line in raw.split("\n"))
        assert set(lines) == {"event", "data"}, f"an event needs 'event' and 'data': {raw!r}"
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def check_stream(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every event's fields, and the order Anthropic's reference gives: message_start;
    per block, content_block_start, its deltas, content_block_stop; message_delta;
    message_stop; pings anywhere after message_start."""
    assert events, "empty stream"
    for name, data in events:
        assert data.get("type") == name, f"the event name is the data's type: {name} {data}"
    assert events[0][0] == "message_start"
    check_message(events[0][1]["message"], streaming_start=True)
    assert events[-1][0] == "message_stop"
    assert "ping" in {name for name, _ in events}
    open_blocks: dict[int, str] = {}
    started = 0
    delta_seen = False
    for name, data in events[1:-1]:
        assert not delta_seen, f"{name} after message_delta"
        if name == "content_block_start":
            has(data, {"index": int, "content_block": dict}, name)
            assert data["index"] == started, "blocks start in index order"
            check_block(data["content_block"], name)
            open_blocks[data["index"]] = data["content_block"]["type"]
            started += 1
        elif name == "content_block_delta":
            has(data, {"index": int, "delta": dict}, name)
            assert data["index"] in open_blocks, "a delta belongs to an open block"
            kind = data["delta"].get("type")
            assert kind in DELTA_FIELDS, kind
            has(data["delta"], DELTA_FIELDS[kind], name)
            assert kind in DELTA_FOR_BLOCK[open_blocks[data["index"]]]
        elif name == "content_block_stop":
            has(data, {"index": int}, name)
            assert open_blocks.pop(data["index"], None) is not None, "stop of an open block"
        elif name == "message_delta":
            assert not open_blocks, "every block stops before message_delta"
            delta = data.get("delta")
            assert isinstance(delta, dict)
            assert delta.get("stop_reason") in STOP_REASONS
            assert "stop_sequence" in delta
            usage = data.get("usage")
            assert isinstance(usage, dict)
            has(usage, {"output_tokens": int}, "message_delta.usage")
            delta_seen = True
        else:
            assert name == "ping", f"unexpected event {name}"
    assert delta_seen, "message_delta is required before message_stop"
