"""A Responses request read and written as the chat-completions body every adapter takes,
and a chat answer written back as Responses output, checked without a server."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.errors import InvalidRequest
from iop_edge.formats.responses_output import OutputShape, Turn
from iop_edge.formats.responses_request import chat_body, read_request
from iop_proto import json_codec


def chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return chat_body(read_request({"model": "m", **body}), history or [])


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    body = chat({"input": "hello", "instructions": "be brief"})
    assert body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ],
    }


def test_list_input_of_every_role_and_part() -> None:
    body = chat(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                    ],
                },
            ]
        }
    )
    assert body["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
            ],
        },
    ]


def test_a_tool_round_trip_becomes_assistant_tool_calls_and_tool_messages() -> None:
    tools = [{"type": "function", "name": "get", "parameters": {"type": "object"}, "strict": False}]
    body = chat(
        {
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
            ],
            "tools": tools,
            "tool_choice": {"type": "function", "name": "get"},
            "parallel_tool_calls": False,
        }
    )
    assert body["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get", "arguments": "{}"}},
        ],
    }
    assert body["messages"][2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "get", "parameters": {"type": "object"}, "strict": False},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert body["parallel_tool_calls"] is False


def test_history_comes_before_the_new_input_and_instructions_before_both() -> None:
    history = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "two"}],
        },
    ]
    body = chat({"input": "three", "instructions": "sys"}, history)
    assert [m["content"] for m in body["messages"]] == ["sys", "one", "two", "three"]


def test_sampling_output_format_and_reasoning_map_to_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = chat(
        {
            "input": "x",
            "stream": True,
            "max_output_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "text": {
                "format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
            },
            "reasoning": {"effort": "low", "summary": "auto"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "metadata": {"k": "v"},
        }
    )
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "A", "schema": schema, "strict": True},
        },
        "reasoning_effort": "low",
    }


def test_the_response_echoes_the_request() -> None:
    request = read_request(
        {"model": "m", "input": "x", "store": False, "metadata": {"k": "v"}, "tools": []}
    )
    echo = request.echo
    assert echo["store"] is False
    assert echo["metadata"] == {"k": "v"}
    assert echo["temperature"] == 1.0
    assert echo["top_p"] == 1.0
    assert echo["tool_choice"] == "auto"
    assert echo["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "model": None}, "model"),
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "teleport"}]}, "tools[0].type"),
        (
            {
                "input": "x",
                "tools": [{"type": "web_search"}],
                "tool_choice": {"type": "web_search"},
            },
            "tool_choice",
        ),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        read_request({"model": "m", **body})
    assert info.value.param == param


def test_a_chat_result_becomes_reasoning_message_and_function_call_items() -> None:
    result = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "calling",
                    "reasoning_content": "hmm",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 2,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 1},
            "completion_tokens_details": {"reasoning_tokens": 1},
        },
    }
    end = Completed("tool_calls", Usage(4, 2, 6), json_codec.dumps(result))
    turn = Turn.of_run(end, ())
    output = turn.output("r", OutputShape())
    assert [(i["type"], i["id"]) for i in output] == [
        ("reasoning", "rs_r"),
        ("message", "msg_r"),
        ("function_call", "fc_r_0"),
    ]
    assert output[2]["call_id"] == "call_9"
    assert output[2]["arguments"] == "{}"
    assert turn.usage_object() == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 6,
    }
    assert turn.incomplete_reason is None


def test_deltas_without_a_result_are_put_together() -> None:
    deltas = (
        Delta(text="a "),
        Delta(text="b"),
        Delta(tool_calls=(ToolCallDelta(0, id="c", function_name="f", function_arguments="{"),)),
        Delta(tool_calls=(ToolCallDelta(0, function_arguments="}"),)),
    )
    turn = Turn.of_run(Completed("length"), deltas)
    output = turn.output("r", OutputShape())
    assert output[0]["content"][0]["text"] == "a b"
    assert output[0]["status"] == "incomplete"
    assert output[1]["arguments"] == "{}"
    assert turn.incomplete_reason == "max_output_tokens"
