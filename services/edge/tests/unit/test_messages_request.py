"""Anthropic Messages requests translated into chat-completions bodies, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.errors import InvalidRequest
from iop_edge.formats.anthropic_request import chat_body, estimate_tokens, prompt_body

WEATHER = {
    "name": "get_weather",
    "description": "The weather.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def test_a_plain_request_becomes_a_chat_body() -> None:
    assert chat_body(body()) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
    }


def test_max_tokens_is_required_and_passed_for_the_pipeline_to_clamp() -> None:
    assert chat_body(body(max_tokens=100_000))["max_tokens"] == 100_000
    for wrong in (None, 0, -1, "10", 1.5, True):
        fields = body(max_tokens=wrong)
        with pytest.raises(InvalidRequest) as info:
            chat_body(fields)
        assert info.value.param == "max_tokens"


def test_system_as_a_string_or_text_blocks_comes_first() -> None:
    blocks = [
        {"type": "text", "text": "You are IOP.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief."},
    ]
    for system, text in (("Be kind.", "Be kind."), (blocks, "You are IOP.\n\nBe brief.")):
        messages = chat_body(body(system=system))["messages"]
        assert messages[0] == {"role": "system", "content": text}
    with pytest.raises(InvalidRequest):
        chat_body(body(system=[{"type": "image"}]))


def test_text_and_image_blocks_become_content_parts() -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
    ]
    [message] = chat_body(body(messages=[{"role": "user", "content": content}]))["messages"]
    assert message == {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
            {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
        ],
    }


def test_tool_use_and_tool_result_blocks_become_chat_tool_turns() -> None:
    turns = [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "is_error": True,
                    "content": [
                        {"type": "text", "text": "no such"},
                        {"type": "text", "text": "city"},
                    ],
                },
                {"type": "text", "text": "Summarise."},
            ],
        },
    ]
    messages = chat_body(body(messages=turns))["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "Checking.",  # the thinking block is not sent back to a chat model
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "toolu_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"},
            },
        ],
    }
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such\ncity"},
        {"role": "user", "content": [{"type": "text", "text": "Summarise."}]},
    ]


def test_an_image_in_a_tool_result_follows_as_a_user_part() -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": "eA=="},
    }
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    messages = chat_body(body(messages=[{"role": "user", "content": [result]}]))["messages"]
    assert messages == [
        {"role": "tool", "tool_call_id": "t", "content": ""},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,eA=="}}],
        },
    ]


def test_tools_become_function_tools() -> None:
    chat = chat_body(body(tools=[WEATHER]))
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather.",
            },
        }
    ]
    assert "tool_choice" not in chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            {
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": False,
            },
        ),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    chat = chat_body(body(tools=[WEATHER], tool_choice=choice))
    assert {k: chat[k] for k in expected} == expected


def test_server_tools_and_unknown_tool_choices_are_refused() -> None:
    for fields in (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}},
        {"tools": [WEATHER], "tool_choice": "auto"},
        {"tools": [{"name": "x"}]},
    ):
        with pytest.raises(InvalidRequest):
            chat_body(body(**fields))


def test_sampling_stops_and_vendor_hooks_pass() -> None:
    chat = chat_body(
        body(
            stop_sequences=["\n\nHuman:"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "u"},
            iop_mock={"fail": "timeout"},
            service_tier="auto",
        ),
    )
    assert chat["stop"] == ["\n\nHuman:"]
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.5, 0.9, 40)
    assert chat["iop_mock"] == {"fail": "timeout"}
    assert "metadata" not in chat
    assert "service_tier" not in chat
    with pytest.raises(InvalidRequest):
        chat_body(body(temperature="hot"))


def test_a_stream_asks_the_provider_for_its_usage() -> None:
    chat = chat_body(body(stream=True))
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert "stream" not in chat_body(body(stream=False))


@pytest.mark.parametrize(
    ("fields", "effort"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10_000}}, "medium"),
        ({"thinking": {"type": "enabled", "budget_tokens": 31_999}}, "high"),
        ({"thinking": {"type": "disabled"}}, None),
        ({"thinking": {"type": "adaptive"}}, None),
        ({"output_config": {"effort": "max"}}, "high"),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}, "low"),
    ],
)
def test_thinking_becomes_the_reasoning_effort(fields: dict[str, Any], effort: str | None) -> None:
    assert chat_body(body(**fields)).get("reasoning_effort") == effort


def test_an_output_format_becomes_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_body(
        body(output_config={"format": {"type": "json_schema", "schema": schema}}),
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_bad_shapes_name_the_field() -> None:
    cases = [
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"stream": "yes"}, "stream"),
    ]
    for fields, param in cases:
        with pytest.raises(InvalidRequest) as info:
            chat_body(body(**fields))
        assert info.value.param == param, fields
    with pytest.raises(InvalidRequest):
        chat_body(
            body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
        )


def test_count_tokens_needs_no_max_tokens_and_estimates_by_bytes() -> None:
    chat = prompt_body({"model": "m", "messages": [{"role": "user", "content": "x" * 40}]})
    assert "max_tokens" not in chat
    size = len('[[{"role":"user","content":"' + "x" * 40 + '"}],null]')
    assert estimate_tokens(chat) == (size + 3) // 4


def test_an_assistant_turn_of_thinking_alone_is_an_empty_text_turn() -> None:
    turn = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "t", "signature": ""}],
    }
    messages = chat_body(body(messages=[turn]))["messages"]
    assert messages == [{"role": "assistant", "content": ""}]
