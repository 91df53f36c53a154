"""Run events as Anthropic Messages objects and SSE events, checked without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.errors import (
    AuthenticationFailed,
    EdgeError,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    NoProviderAvailable,
    ProviderFailed,
    ProviderTimeout,
    QueueFull,
    QueueTimeout,
    RequestTooLarge,
    ShuttingDown,
)
from iop_edge.formats.anthropic import (
    MessageStream,
    error_body,
    error_status,
    render_message,
    signature,
)
from iop_edge.formats.errors import internal_error


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        head, data = frame.split("\n")
        assert head.startswith("event: ")
        assert data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == head.removeprefix("event: ")
        out.append((head.removeprefix("event: "), payload))
    return out


def stream_of(deltas: list[Delta], end: Completed) -> list[tuple[str, dict[str, Any]]]:
    stream = MessageStream(message_id="msg_r1", model="pub")
    raw = stream.opening() + b"".join(stream.delta(d) for d in deltas) + stream.closing(end)
    return events(raw)


def test_a_text_stream_in_anthropics_order() -> None:
    seen = stream_of(
        [Delta(text="Hel", role="assistant"), Delta(text='lo "x"\n')],
        Completed(finish_reason="length", usage=Usage(7, 2, 9)),
    )
    assert [name for name, _ in seen] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = seen[0][1]["message"]
    assert start["id"] == "msg_r1"
    assert start["model"] == "pub"
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert seen[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [e[1]["delta"] for e in seen[3:5]] == [
        {"type": "text_delta", "text": "Hel"},
        {"type": "text_delta", "text": 'lo "x"\n'},
    ]
    assert seen[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {
            "input_tokens": 7,
            "output_tokens": 2,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def test_thinking_then_text_then_tool_calls_are_blocks_in_turn() -> None:
    head = ToolCallDelta(0, id="call_a", type="function", function_name="get_weather")
    second = ToolCallDelta(1, function_name="lookup")  # a provider that names no id
    seen = stream_of(
        [
            Delta(reasoning_text="Let me "),
            Delta(reasoning_text="think."),
            Delta(text="Checking."),
            Delta(tool_calls=(head,)),
            Delta(tool_calls=(ToolCallDelta(0, function_arguments='{"city":'),)),
            Delta(tool_calls=(ToolCallDelta(0, function_arguments='"Paris"}'),)),
            Delta(tool_calls=(second,)),
        ],
        Completed(finish_reason="tool_calls", usage=Usage(3, 9, 12)),
    )
    blocks = [e for n, e in seen if n == "content_block_start"]
    assert [b["content_block"]["type"] for b in blocks] == [
        "thinking",
        "text",
        "tool_use",
        "tool_use",
    ]
    assert [b["index"] for b in blocks] == [0, 1, 2, 3]
    assert blocks[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert blocks[2]["content_block"] == {
        "type": "tool_use",
        "id": "call_a",
        "name": "get_weather",
        "input": {},
    }
    assert blocks[3]["content_block"]["id"] == "toolu_r1_1"
    deltas = [(e["index"], e["delta"]) for n, e in seen if n == "content_block_delta"]
    assert deltas == [
        (0, {"type": "thinking_delta", "thinking": "Let me "}),
        (0, {"type": "thinking_delta", "thinking": "think."}),
        (0, {"type": "signature_delta", "signature": signature("Let me think.")}),
        (1, {"type": "text_delta", "text": "Checking."}),
        (2, {"type": "input_json_delta", "partial_json": '{"city":'}),
        (2, {"type": "input_json_delta", "partial_json": '"Paris"}'}),
    ]
    stops = [e["index"] for n, e in seen if n == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    assert seen[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_an_empty_run_still_opens_and_closes_the_message() -> None:
    seen = stream_of([], Completed(finish_reason="stop"))
    assert [name for name, _ in seen] == ["message_start", "ping", "message_delta", "message_stop"]
    assert seen[2][1]["delta"]["stop_reason"] == "end_turn"
    assert seen[2][1]["usage"] == {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def test_other_choices_are_ignored_and_usage_from_a_delta_counts() -> None:
    seen = stream_of(
        [Delta(text="a"), Delta(text="b", choice_index=1), Delta(usage=Usage(4, 1, 5))],
        Completed(finish_reason="stop"),
    )
    texts = [e["delta"]["text"] for n, e in seen if n == "content_block_delta"]
    assert texts == ["a"]
    assert seen[-2][1]["usage"] == {
        "input_tokens": 4,
        "output_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def test_a_failure_mid_stream_is_an_error_event() -> None:
    stream = MessageStream(message_id="msg_r", model="m")
    [(name, payload)] = events(stream.failure(ProviderFailed("boom")))
    assert name == "error"
    assert payload == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def chat_result(message: dict[str, Any], finish: str, **choice: Any) -> bytes:
    result = {
        "id": "chatcmpl-provider",
        "object": "chat.completion",
        "model": "served-name",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16},
    }
    return json.dumps(result).encode()


def test_a_chat_result_becomes_a_message() -> None:
    end = Completed(
        finish_reason="stop",
        result_json=chat_result(
            {"role": "assistant", "content": "Hi.", "reasoning_content": "greet"}, "stop"
        ),
    )
    message = render_message(end, [], message_id="msg_r", model="pub")
    assert message == {
        "id": "msg_r",
        "type": "message",
        "role": "assistant",
        "model": "pub",
        "content": [
            {"type": "thinking", "thinking": "greet", "signature": signature("greet")},
            {"type": "text", "text": "Hi."},
        ],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 11,
            "output_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def test_tool_calls_become_tool_use_blocks_with_parsed_input() -> None:
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    end = Completed(
        result_json=chat_result({"role": "assistant", "content": None, "tool_calls": calls}, "stop")
    )
    message = render_message(end, [], message_id="msg_r", model="pub")
    assert message["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "toolu_r_1", "name": "g", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use"


def test_a_stop_sequence_the_provider_names_is_reported() -> None:
    result = chat_result({"role": "assistant", "content": "x"}, "stop", stop_reason="END")
    message = render_message(
        Completed(result_json=result), [], message_id="m", model="p", stop_sequences=("END",)
    )
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")


def test_a_message_from_deltas_when_the_provider_sent_no_result() -> None:
    deltas = [
        Delta(text="a", role="assistant"),
        Delta(text="b", reasoning_text="r"),
        Delta(tool_calls=(ToolCallDelta(0, id="c", function_name="f", function_arguments="{}"),)),
    ]
    end = Completed(finish_reason="length", usage=Usage(2, 3, 5))
    message = render_message(end, deltas, message_id="msg_x", model="p")
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][1]["text"] == "ab"
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"]["output_tokens"] == 3


def test_a_broken_result_is_a_provider_failure() -> None:
    for raw in (b"nope", b"[]", b'{"choices": []}'):
        with pytest.raises(ProviderFailed):
            render_message(Completed(result_json=raw), [], message_id="m", model="p")


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequest("x"), 400, "invalid_request_error"),
        (AuthenticationFailed("x"), 401, "authentication_error"),
        (ModelNotAllowed("x"), 403, "permission_error"),
        (ModelNotFound("x"), 404, "not_found_error"),
        (RequestTooLarge("x"), 413, "request_too_large"),
        (QueueFull("x"), 429, "rate_limit_error"),
        (ProviderFailed("x"), 502, "api_error"),
        (ProviderTimeout("x"), 504, "timeout_error"),
        (NoProviderAvailable("x"), 529, "overloaded_error"),
        (QueueTimeout("x"), 529, "overloaded_error"),
        (ShuttingDown("x"), 529, "overloaded_error"),
        (internal_error(), 500, "api_error"),
    ],
)
def test_errors_in_anthropics_shape(error: EdgeError, status: int, kind: str) -> None:
    assert error_status(error) == status
    assert error_body(error) == {"type": "error", "error": {"type": kind, "message": error.message}}
