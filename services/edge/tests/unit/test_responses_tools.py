"""Namespace, custom and hosted tools of a Responses request, and sealed reasoning: what the
engine is offered, how its calls come back, and how a client's items go back to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from iop_edge.bootstrap import reasoning_seal
from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.errors import InvalidRequest
from iop_edge.formats.reasoning_seal import ReasoningSeal, parse_key
from iop_edge.formats.responses_output import OutputShape, Turn
from iop_edge.formats.responses_request import chat_body, read_request
from iop_edge.formats.responses_stream import ResponseEventStream
from iop_edge.settings import EdgeSettings
from iop_proto.tls import TlsSettings

CODEX_REQUEST = Path(__file__).parents[1] / "data" / "codex-0.171-request.json"
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn one.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
        }
    ],
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
DIGITS = {
    "type": "custom",
    "name": "digits",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"},
}


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def call(index: int, name: str, arguments: str, call_id: str = "call_1") -> Delta:
    part = ToolCallDelta(index, call_id, function_name=name, function_arguments=arguments)
    return Delta(tool_calls=(part,))


def test_a_namespace_offers_its_functions_by_flat_name_and_its_calls_come_back_namespaced() -> None:
    asked = read_request(request(tools=[AGENTS]))
    chat = chat_body(asked, ())
    (tool,) = chat["tools"]
    assert tool["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert tool["function"]["parameters"] == AGENTS["tools"][0]["parameters"]  # type: ignore[index]
    assert asked.echo["tools"][0]["type"] == "namespace"
    turn = Turn.of_run(
        Completed("tool_calls", Usage(1, 1, 2)),
        [call(0, "multi_agent_v1__spawn_agent", '{"task": "x"}')],
    )
    (item,) = turn.output("r", OutputShape(asked.tools))
    assert item["type"] == "function_call"
    assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    # Codex sends the call back as it got it: the engine sees the flat name again.
    back = read_request(
        request(
            tools=[AGENTS],
            input=[item, {"type": "function_call_output", "call_id": "call_1", "output": "ok"}],
        )
    )
    messages = chat_body(back, ())["messages"]
    assert messages[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert messages[1] == {"role": "tool", "tool_call_id": "call_1", "content": "ok"}


def test_an_mcp_style_namespace_keeps_one_separator() -> None:
    tools = [{**AGENTS, "name": "mcp__srv__"}]
    chat = chat_body(read_request(request(tools=tools)), ())
    assert chat["tools"][0]["function"]["name"] == "mcp__srv__spawn_agent"


def test_a_custom_tool_is_a_one_string_function_and_its_call_a_custom_tool_call() -> None:
    asked = read_request(
        request(tools=[PATCH, DIGITS], tool_choice={"type": "custom", "name": "digits"})
    )
    chat = chat_body(asked, ())
    patch, digits = (tool["function"] for tool in chat["tools"])
    assert patch["parameters"]["required"] == ["input"]
    # Lark has no JSON-schema form: described to the model, not enforced.
    assert 'start: "*** Begin Patch"' in patch["parameters"]["properties"]["input"]["description"]
    assert "pattern" not in patch["parameters"]["properties"]["input"]
    # A regex is the parameter's pattern, which schema-constrained engines enforce.
    assert digits["parameters"]["properties"]["input"]["pattern"] == "[0-9]+"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "digits"}}
    turn = Turn.of_run(
        Completed("tool_calls", Usage(1, 1, 2)),
        [call(0, "apply_patch", json.dumps({"input": "*** Begin Patch\n"}))],
    )
    (item,) = turn.output("r", OutputShape(asked.tools))
    assert item["type"] == "custom_tool_call"
    assert item["id"] == "ctc_r_0"
    assert (item["name"], item["input"], item["call_id"]) == (
        "apply_patch",
        "*** Begin Patch\n",
        "call_1",
    )
    back = read_request(
        request(
            tools=[PATCH],
            input=[
                item,
                {"type": "custom_tool_call_output", "call_id": "call_1", "output": "done"},
            ],
        )
    )
    first, second = chat_body(back, ())["messages"]
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {
        "input": "*** Begin Patch\n"
    }
    assert second == {"role": "tool", "tool_call_id": "call_1", "content": "done"}


def test_hosted_tools_are_dropped_and_named_and_cannot_be_chosen() -> None:
    asked = read_request(
        request(tools=[{"type": "web_search"}, {"type": "tool_search"}, {"type": "web_search"}])
    )
    assert asked.tools.dropped == ("web_search", "tool_search")
    assert asked.echo["tools"] == []
    assert "tools" not in chat_body(asked, ())
    with pytest.raises(InvalidRequest) as info:
        read_request(request(tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}))
    assert info.value.param == "tool_choice"
    assert "web_search" in info.value.message
    dated = read_request(request(tools=[{"type": "web_search_2025_08_26"}]))
    assert dated.tools.dropped == ("web_search_2025_08_26",)


def test_allowed_tools_offers_only_those_listed() -> None:
    weather = {"type": "function", "name": "weather"}
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "weather"}, {"type": "web_search"}],
    }
    chat = chat_body(read_request(request(tools=[weather, AGENTS], tool_choice=choice)), ())
    assert [t["function"]["name"] for t in chat["tools"]] == ["weather"]
    assert chat["tool_choice"] == "required"


def test_the_codex_request_is_read_and_offered_without_its_hosted_tool() -> None:
    body = json.loads(CODEX_REQUEST.read_text())
    asked = read_request(body)
    assert asked.tools.dropped == ("web_search",)
    assert asked.sealed_reasoning
    assert asked.echo["prompt_cache_key"] == body["prompt_cache_key"]
    chat = chat_body(asked, ())
    names = [tool["function"]["name"] for tool in chat["tools"]]
    assert "multi_agent_v1__spawn_agent" in names
    assert "exec_command" in names
    assert len(names) == len(set(names)) == 12


def test_reasoning_is_sealed_for_the_client_and_opened_into_the_next_assistant_turn() -> None:
    seal = ReasoningSeal.generate()
    asked = read_request(request(include=["reasoning.encrypted_content"], store=False))
    turn = Turn.of_run(
        Completed("stop", Usage(1, 1, 2)), [Delta(reasoning_text="think"), Delta(text="answer")]
    )
    reasoning, message = turn.output("r", OutputShape(asked.tools, seal.seal))
    assert reasoning["type"] == "reasoning"
    assert reasoning["summary"] == []
    sealed = reasoning["encrypted_content"]
    assert isinstance(sealed, str)
    assert "think" not in sealed
    assert seal.open(sealed) == "think"
    follow = read_request(
        request(
            input=[
                {"type": "message", "role": "user", "content": "q"},
                {k: v for k, v in reasoning.items() if k != "content"},  # as Codex sends it
                message,
                {"type": "message", "role": "user", "content": "and?"},
            ]
        )
    )
    messages = chat_body(follow, (), seal.open)["messages"]
    assert messages[1] == {"role": "assistant", "content": "answer", "reasoning_content": "think"}
    assert "reasoning_content" not in messages[2]


def test_foreign_reasoning_and_compaction_items_are_skipped_never_refused() -> None:
    seal = ReasoningSeal.generate()
    other = ReasoningSeal.generate().seal("another fleet's")
    tampered = seal.seal("mine")[:-4] + "AAAA"
    items = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAABopenai"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": other},
        {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": tampered},
        {"type": "reasoning", "id": "rs_4", "summary": []},
        {"type": "compaction", "encrypted_content": "opaque"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {}},
        {"type": "message", "role": "assistant", "content": "a"},
    ]
    messages = chat_body(read_request(request(input=items)), (), seal.open)["messages"]
    assert messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert seal.open("iop1.%%%") is None
    assert seal.open("iop1.") is None


def test_an_empty_reasoning_round_trips() -> None:
    seal = ReasoningSeal.generate()
    token = seal.seal("")
    assert seal.open(token) == ""
    items = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": token},
        {"type": "message", "role": "assistant", "content": "a"},
    ]
    messages = chat_body(read_request(request(input=items)), (), seal.open)["messages"]
    assert messages[1] == {"role": "assistant", "content": "a"}


def test_a_key_file_is_hex_or_base64_of_32_bytes() -> None:
    key = bytes(range(32))
    assert parse_key(key.hex() + "\n") == key
    assert parse_key("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=") == key
    with pytest.raises(ValueError, match="64 hex digits"):
        parse_key("abc")
    sealed = ReasoningSeal(key).seal("shared")
    assert ReasoningSeal(parse_key(key.hex())).open(sealed) == "shared"  # another edge


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(frame.split(b"\ndata: ", 1)[1]) for frame in raw.split(b"\n\n") if frame]


def test_a_streamed_custom_call_sends_its_input_whole_and_a_namespaced_call_its_namespace() -> None:
    asked = read_request(request(tools=[AGENTS, PATCH], stream=True))
    stream = ResponseEventStream(asked.echo, "r", 1, OutputShape(asked.tools), lambda: 5.0)
    out = stream.opening()
    out += stream.delta(call(0, "apply_patch", '{"input": "*** Be', "c0"))
    out += stream.delta(call(0, "", 'gin Patch"}', ""))
    out += stream.delta(call(1, "multi_agent_v1__spawn_agent", '{"task":', "c1"))
    out += stream.delta(call(1, "", '"x"}', ""))
    out += stream.closing(Completed("tool_calls", Usage(1, 2, 3)))
    seen = events(out)
    kinds = [event["type"] for event in seen]
    assert "response.custom_tool_call_input.done" in kinds
    (done_input,) = (e for e in seen if e["type"] == "response.custom_tool_call_input.done")
    assert done_input["input"] == "*** Begin Patch"
    (args_done,) = (e for e in seen if e["type"] == "response.function_call_arguments.done")
    assert args_done["name"] == "spawn_agent"
    final = seen[-1]["response"]
    assert final["completed_at"] == 5
    custom, function = final["output"]
    assert (custom["type"], custom["input"], custom["id"]) == (
        "custom_tool_call",
        "*** Begin Patch",
        "ctc_r_0",
    )
    assert (function["name"], function["namespace"], function["arguments"]) == (
        "spawn_agent",
        "multi_agent_v1",
        '{"task":"x"}',
    )


def test_streamed_reasoning_is_sealed_when_done() -> None:
    seal = ReasoningSeal.generate()
    asked = read_request(request(stream=True, include=["reasoning.encrypted_content"]))
    stream = ResponseEventStream(asked.echo, "r", 1, OutputShape(asked.tools, seal.seal), float)
    out = (
        stream.opening() + stream.delta(Delta(reasoning_text="hm")) + stream.delta(Delta(text="a"))
    )
    out += stream.closing(Completed("stop", Usage(1, 2, 3)))
    seen = events(out)
    added = next(e for e in seen if e["type"] == "response.output_item.added")
    assert "encrypted_content" not in added["item"]  # nothing to seal yet
    done = next(e for e in seen if e["type"] == "response.output_item.done")
    assert seal.open(done["item"]["encrypted_content"]) == "hm"
    assert (
        seen[-1]["response"]["output"][0]["encrypted_content"] == done["item"]["encrypted_content"]
    )


def test_the_edge_s_seal_comes_from_its_key_file(tmp_path: Path) -> None:
    key = bytes(range(32))
    path = tmp_path / "reasoning.key"
    path.write_text(key.hex() + "\n")
    tls = TlsSettings(enabled=False)
    one = reasoning_seal(EdgeSettings(tls=tls, reasoning_key_file=path))
    other = reasoning_seal(EdgeSettings(tls=tls, reasoning_key_file=path))
    assert other.open(one.seal("shared by the fleet")) == "shared by the fleet"
    alone = reasoning_seal(EdgeSettings(tls=tls))
    assert alone.open(one.seal("x")) is None
    path.write_text("not a key")
    with pytest.raises(ValueError, match="reasoning_key_file"):
        reasoning_seal(EdgeSettings(tls=tls, reasoning_key_file=path))


def test_the_reasoning_of_a_stored_chain_goes_back_in_the_clear_a_client_s_does_not() -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "stored thought"}],
    }
    answer = {"type": "message", "role": "assistant", "content": "a"}
    history = [{"type": "message", "role": "user", "content": "q"}, reasoning, answer]
    follow = read_request(request(previous_response_id="resp_1", input="and?"))
    messages = chat_body(follow, history)["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "stored thought",
    }
    sent = read_request(request(input=history))  # the same items from the client: not trusted
    assert "reasoning_content" not in chat_body(sent, ())["messages"][1]


def test_tool_choice_may_name_a_namespaced_function_alone_when_it_is_unique() -> None:
    chosen = {"type": "function", "name": "spawn_agent"}
    chat = chat_body(read_request(request(tools=[AGENTS], tool_choice=chosen)), ())
    assert chat["tool_choice"] == {
        "type": "function",
        "function": {"name": "multi_agent_v1__spawn_agent"},
    }
