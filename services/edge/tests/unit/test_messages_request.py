"""Anthropic Messages requests translated into chat-completions bodies, without a server."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from iop_edge.errors import InvalidRequest
from iop_edge.formats.anthropic_request import (
    BASH_SCHEMA,
    EDITOR_SCHEMA,
    chat_body,
    dropped_tools,
    estimate_tokens,
    prompt_body,
)

CLAUDE_CODE: Path = (
    Path(__file__).resolve().parents[4] / "tests/e2e/data/claude_code_2.1.197_messages.json"
)
"""A request Claude Code 2.1.197 sent (texts trimmed): see the file's ``comment``."""

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


def test_unknown_tool_choices_and_tools_without_a_schema_are_refused() -> None:
    for fields in (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}},
        {
            "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "web_search"},  # not offered
        },
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
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),  # no turn
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system"}]}, "messages.1"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
        ({"system": [{"type": "text", "text": 1}]}, "system.0"),
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


# ---------------------------------------------------------------- what Claude Code sends

SERVER_TOOLS = [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "web_fetch_20250910", "name": "web_fetch"},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"type": "computer_20250124", "name": "computer", "display_width_px": 1024},
    {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
    {"type": "mcp_toolset", "mcp_server_name": "docs"},
    {"type": "web_search_20250305", "name": "web_search_2"},
]


def note(text: str) -> dict[str, str]:
    return {"type": "text", "text": f"<system>\n{text}\n</system>"}


def test_system_messages_before_any_turn_join_the_leading_system_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "hi"},
    ]
    chat = chat_body(body(system="You are IOP.", messages=messages))
    assert chat["messages"] == [
        {"role": "system", "content": "You are IOP.\n\nBe brief.\n\nUse tools."},
        {"role": "user", "content": "hi"},
    ]


def test_a_later_system_message_is_a_note_in_the_user_turn_beside_it() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "after a user turn"},
        {"role": "assistant", "content": [call]},
        {"role": "system", "content": [{"type": "text", "text": "after an assistant turn"}]},
        {"role": "user", "content": [result, {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": "done"},
        {"role": "system", "content": "last"},
    ]
    chat = chat_body(body(messages=messages, tools=[WEATHER]))
    assert [m["role"] for m in chat["messages"]] == [
        "user",
        "assistant",
        "tool",
        "user",
        "assistant",
        "user",
    ]
    first, _, tool, user, _, last = chat["messages"]
    assert first["content"] == [{"type": "text", "text": "hi"}, note("after a user turn")]
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert user["content"] == [note("after an assistant turn"), {"type": "text", "text": "and?"}]
    assert last == {"role": "user", "content": [note("last")]}


def test_a_note_left_before_an_assistant_turn_is_a_user_turn_of_its_own() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [call]},
        {"role": "system", "content": "note"},
        {"role": "user", "content": [result]},  # a tool turn only: no user text to join
        {"role": "assistant", "content": "done"},
    ]
    chat = chat_body(body(messages=messages, tools=[WEATHER]))
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]
    assert chat["messages"][3] == {"role": "user", "content": [note("note")]}


def test_claude_codes_billing_header_never_reaches_the_model() -> None:
    header = "x-anthropic-billing-header: cc_version=2.1.197.6e2; cc_entrypoint=cli; cch=1a2b3;"
    blocks = [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude."}]
    for system in (blocks, header + "\nYou are Claude."):
        chat = chat_body(body(system=system))
        assert chat["messages"][0] == {"role": "system", "content": "You are Claude."}
    chat = chat_body(body(system=[blocks[0]]))
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


def test_server_tools_are_left_out_and_named() -> None:
    fields = body(tools=[WEATHER, *SERVER_TOOLS], tool_choice={"type": "any"})
    chat = chat_body(fields)
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert chat["tool_choice"] == "required"
    assert dropped_tools(fields) == (
        "web_search_20250305",
        "web_fetch_20250910",
        "code_execution_20250825",
        "computer_20250124",
        "tool_search_tool_regex_20251119",
        "mcp_toolset",
    )
    only_server = chat_body(body(tools=SERVER_TOOLS[:1]))
    assert "tools" not in only_server
    assert dropped_tools(body(tools=[WEATHER])) == ()
    assert dropped_tools(body()) == ()


def test_anthropics_schemaless_client_tools_are_offered_with_their_documented_input() -> None:
    tools = [
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {"type": "text_editor_20250124", "name": "str_replace_editor", "cache_control": {}},
    ]
    fields = body(tools=tools, tool_choice={"type": "tool", "name": "bash"})
    chat = chat_body(fields)
    offered = {t["function"]["name"]: t["function"]["parameters"] for t in chat["tools"]}
    assert offered == {
        "bash": BASH_SCHEMA,
        "str_replace_based_edit_tool": EDITOR_SCHEMA,
        "str_replace_editor": EDITOR_SCHEMA,
    }
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "bash"}}
    assert dropped_tools(fields) == ()
    with pytest.raises(InvalidRequest) as info:
        chat_body(body(tools=[{"type": "bash_20250124"}]))
    assert info.value.param == "tools.0"


def test_server_tool_blocks_in_the_history_are_left_out() -> None:
    search = {"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {}}
    found = {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []}
    messages = [
        {"role": "user", "content": "news?"},
        {"role": "assistant", "content": [search, found, {"type": "text", "text": "None."}]},
        {"role": "user", "content": [found, {"type": "text", "text": "ok"}]},
    ]
    chat = chat_body(body(messages=messages))
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": "None."},
        {"role": "user", "content": [{"type": "text", "text": "ok"}]},
    ]


def claude_code_request() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(CLAUDE_CODE.read_text("utf-8"))["body"]
    return body


def test_claude_codes_request_becomes_a_chat_body() -> None:
    sent = claude_code_request()
    chat = chat_body(sent)
    system, user = chat["messages"]
    assert system["role"] == "system"
    assert system["content"].startswith("You are a Claude agent")
    assert "billing" not in json.dumps(chat)
    assert user["role"] == "user"
    assert [p["text"][:18] for p in user["content"]] == [
        "<system-reminder>\n",
        "List the files in ",
        "<system>\nAvailable",  # messages.1, the mid-conversation system message
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in sent["tools"]]
    assert chat["reasoning_effort"] == "high"  # output_config.effort; thinking adaptive
    assert chat["stream"] is True
    for unsent in ("metadata", "context_management", "thinking", "output_config"):
        assert unsent not in chat
    assert "cache_control" not in json.dumps(chat)


def next_turn(request: dict[str, Any], turn: int, cch: str) -> dict[str, Any]:
    """The request Claude Code sends after a tool call: the same conversation, one call
    and its result longer, and a billing header with a new body hash."""
    later = copy.deepcopy(request)
    header = later["system"][0]
    header["text"] = header["text"].rstrip() + f" cch={cch};"
    call_id = f"toolu_0{turn}"
    later["messages"] += [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "List them.", "signature": "sig"},
                {"type": "tool_use", "id": call_id, "name": "Bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call_id,
                    "content": f"file{turn}.py",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    return later


def test_consecutive_claude_code_requests_share_a_byte_identical_chat_prefix() -> None:
    """An engine's prefix cache holds only if each request's prompt starts with the
    previous one's: the billing header (a new hash each time) must not be in it."""
    first = next_turn(claude_code_request(), 1, "a1b2c")
    second = next_turn(first, 2, "d3e4f")
    assert first["system"][0]["text"] != second["system"][0]["text"]
    one, two = (chat_body(r) for r in (first, second))
    assert json.dumps(one["tools"]) == json.dumps(two["tools"])
    earlier = json.dumps(one["messages"])[:-1]  # without the closing bracket
    assert json.dumps(two["messages"]).startswith(earlier + ",")
    assert len(two["messages"]) == len(one["messages"]) + 2
