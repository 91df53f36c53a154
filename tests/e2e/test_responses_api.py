"""The Responses API (``/v1/responses``) through a real edge, control-plane and mock nodes,
driven by the clients that speak it: the official ``openai`` SDK, the OpenAI Agents SDK,
LangChain's ``ChatOpenAI(use_responses_api=True)``, and a request shaped as Codex CLI
sends it. Every Response object and streamed event the stack returns is held to the
fields OpenAI's OpenAPI document requires (``REQUIRED``, ``EVENT_REQUIRED``) and to the
Open Responses specification's contract (``responses_contract``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import httpx
import openai
import pydantic
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # the `stack` fixture of conftest.py (a conftest cannot be imported)
MODEL = "mock-small"
CODEX_REQUEST = Path(__file__).parents[2] / "services/edge/tests/data/codex-0.171-request.json"


def _load_contract() -> ModuleType:
    """The specification's contract, shared with the llama.cpp test (test modules are not
    a package)."""
    path = Path(__file__).with_name("responses_contract.py")
    spec = importlib.util.spec_from_file_location("iop_e2e_responses_contract", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


spec_contract = _load_contract()

# The required fields of OpenAI's openapi.json (github.com/openai/openai-openapi), by schema.
REQUIRED: dict[str, set[str]] = {
    "Response": {
        "id", "object", "created_at", "error", "incomplete_details", "instructions",
        "metadata", "model", "output", "parallel_tool_calls", "temperature", "tool_choice",
        "tools", "top_p",
    },
    "message": {"id", "type", "role", "status", "content"},
    "output_text": {"type", "text", "annotations", "logprobs"},
    "function_call": {"type", "call_id", "name", "arguments"},
    "custom_tool_call": {"type", "call_id", "name", "input"},
    "reasoning": {"id", "type", "summary"},
    "ResponseUsage": {
        "input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
        "total_tokens",
    },
    "ResponseItemList": {"object", "data", "first_id", "last_id", "has_more"},
}  # fmt: skip
EVENT_REQUIRED: dict[str, set[str]] = {
    "response.created": {"response"},
    "response.in_progress": {"response"},
    "response.output_item.added": {"item", "output_index"},
    "response.content_part.added": {"content_index", "item_id", "output_index", "part"},
    "response.output_text.delta": {"content_index", "delta", "item_id", "logprobs", "output_index"},
    "response.output_text.done": {"content_index", "item_id", "logprobs", "output_index", "text"},
    "response.content_part.done": {"content_index", "item_id", "output_index", "part"},
    "response.function_call_arguments.delta": {"delta", "item_id", "output_index"},
    "response.function_call_arguments.done": {"arguments", "item_id", "name", "output_index"},
    "response.custom_tool_call_input.delta": {"delta", "item_id", "output_index"},
    "response.custom_tool_call_input.done": {"input", "item_id", "output_index"},
    "response.reasoning_text.delta": {"content_index", "delta", "item_id", "output_index"},
    "response.reasoning_text.done": {"content_index", "item_id", "output_index", "text"},
    "response.output_item.done": {"item", "output_index"},
    "response.completed": {"response"},
    "response.incomplete": {"response"},
    "response.failed": {"response"},
    "error": {"code", "message", "param"},
}
"""Every event also requires ``type`` and ``sequence_number``."""


def check_response(response: dict[str, Any], *, wire: bool = True) -> None:
    """``response`` (a Response object as JSON) has every field OpenAI's reference
    requires, and, as it came over the wire (not an SDK's dump, which retypes integers
    and fills in what was absent), what the Open Responses specification requires."""
    if wire:
        spec_contract.check_response(response)
    assert REQUIRED["Response"] <= response.keys(), REQUIRED["Response"] - response.keys()
    assert response["object"] == "response"
    assert re.fullmatch(r"resp_\S+", response["id"])
    for item in response["output"]:
        check_item(item)
    if response.get("usage") is not None:
        usage = response["usage"]
        assert REQUIRED["ResponseUsage"] <= usage.keys()
        assert {"cached_tokens", "cache_write_tokens"} <= usage["input_tokens_details"].keys()
        assert "reasoning_tokens" in usage["output_tokens_details"]


def check_item(item: dict[str, Any]) -> None:
    assert REQUIRED[item["type"]] <= item.keys(), item
    if item["type"] == "message":
        assert item["id"].startswith("msg_")
        for part in item["content"]:
            assert REQUIRED[part["type"]] <= part.keys()
    elif item["type"] == "function_call":
        assert item["id"].startswith("fc_")


def check_events(events: list[dict[str, Any]]) -> None:
    """The events of one stream: each with its required fields, numbered in order, and in
    OpenAI's order (created, in_progress, items each opened and closed, one terminal)."""
    spec_contract.check_events(events)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        assert EVENT_REQUIRED[event["type"]] <= event.keys(), event
        if "response" in event:
            check_response(event["response"])
        if "item" in event:
            check_item(event["item"])
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    open_item: int | None = None
    for event in events[2:-1]:
        if event["type"] == "response.output_item.added":
            assert open_item is None  # one item at a time
            open_item = event["output_index"]
        elif event["type"] == "response.output_item.done":
            assert event["output_index"] == open_item
            open_item = None
        else:
            assert event["output_index"] == open_item
    assert open_item is None


async def issue_key(stack: Stack, name: str) -> str:
    out = await stack.control_plane_cli("key", "issue", "--name", name)
    secret = re.search(r"sk-iop-\S+", out)
    assert secret is not None, out
    return secret.group(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keys(stack: Stack) -> dict[str, str]:
    """Two tenants' keys, once the edge knows them (the API is then closed to others)."""
    issued = {name: await issue_key(stack, f"responses-{name}") for name in ("a", "b")}
    async with asyncio.timeout(10):
        for secret in issued.values():
            async with AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0) as c:
                while True:
                    try:
                        await c.models.list()
                        break
                    except openai.AuthenticationError:
                        await asyncio.sleep(0.05)
    return issued


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack, keys: dict[str, str]) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key=keys["a"], max_retries=0) as client:
        yield client


async def sse(stack: Stack, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's events, each ``event:`` line checked against its data's type."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            assert reply.content_type == "text/event-stream"
            raw = (await reply.read()).decode()
    events = []
    for frame in filter(None, raw.split("\n\n")):
        head, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    return events


async def test_create_with_string_input(
    stack: Stack, sdk: AsyncOpenAI, keys: dict[str, str]
) -> None:
    response = await sdk.responses.create(model=MODEL, input="tell me something")
    check_response(response.model_dump(), wire=False)
    assert response.status == "completed"
    assert response.output_text
    assert response.model == MODEL
    assert response.usage is not None
    assert response.usage.input_tokens == 3
    assert response.usage.output_tokens > 0
    # One run in the run log, under the response's id, as for chat.
    runs_url = stack.api_url.replace("/v1", "/iop/v1/runs")
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {keys['a']}"}
        async with http.get(runs_url, headers=headers) as reply:
            runs = (await reply.json())["data"]
    (run,) = [r for r in runs if f"resp_{r['run_id']}" == response.id]
    assert run["outcome"] == "completed"
    assert run["completion_tokens"] == response.usage.output_tokens


async def test_create_with_list_input_and_instructions(sdk: AsyncOpenAI) -> None:
    response = await sdk.responses.create(
        model=MODEL,
        instructions="answer briefly",
        input=[
            {"role": "developer", "content": "no jokes"},
            {"role": "user", "content": [{"type": "input_text", "text": "one two"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "three"}]},
            {"role": "user", "content": "four"},
        ],
        max_output_tokens=4,
        metadata={"ticket": "17"},
    )
    check_response(response.model_dump(), wire=False)
    assert response.instructions == "answer briefly"
    assert response.metadata == {"ticket": "17"}
    assert response.status == "incomplete"  # the mock stops at max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.input_tokens == 8  # every message's words, instructions included
    assert response.usage.output_tokens == 4


async def test_stream_events_in_order_and_text_assembled(sdk: AsyncOpenAI) -> None:
    kinds: list[str] = []
    deltas: list[str] = []
    async with sdk.responses.stream(model=MODEL, input="stream please") as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == "".join(deltas) != ""
    check_response(final.model_dump(), wire=False)


async def test_raw_stream_meets_the_event_contract(stack: Stack, keys: dict[str, str]) -> None:
    events = await sse(stack, keys["a"], {"model": MODEL, "input": "x", "stream": True})
    check_events(events)
    capped = await sse(
        stack, keys["a"], {"model": MODEL, "input": "x", "stream": True, "max_output_tokens": 2}
    )
    check_events(capped)
    assert capped[-1]["type"] == "response.incomplete"


async def test_tool_round_trip_with_previous_response_id(sdk: AsyncOpenAI) -> None:
    tools: Any = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        }
    ]
    first = await sdk.responses.create(model=MODEL, input="weather in Paris?", tools=tools)
    check_response(first.model_dump(), wire=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    second = await sdk.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
    )
    check_response(second.model_dump(), wire=False)
    assert second.previous_response_id == first.id
    assert second.output_text  # after a tool result the mock answers in text
    assert [item.type for item in second.output] == ["message"]
    refused = await sdk.responses.create(
        model=MODEL, input="weather?", tools=tools, tool_choice="none"
    )
    assert [item.type for item in refused.output] == ["message"]  # no call when told none


async def test_streamed_tool_call(stack: Stack, keys: dict[str, str]) -> None:
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    events = await sse(
        stack,
        keys["a"],
        {"model": MODEL, "input": "x", "stream": True, "tools": [tool], "tool_choice": "required"},
    )
    check_events(events)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["name"] for e in done] == ["lookup"]
    final = events[-1]["response"]
    assert final["output"][-1]["type"] == "function_call"
    assert final["output"][-1]["arguments"] == done[0]["arguments"]


async def test_structured_output_with_text_format(sdk: AsyncOpenAI) -> None:
    class Weather(pydantic.BaseModel):
        city: str
        degrees: int

    parsed = await sdk.responses.parse(model=MODEL, input="weather?", text_format=Weather)
    check_response(parsed.model_dump(), wire=False)
    assert isinstance(parsed.output_parsed, Weather)  # the mock answers with a valid instance
    assert parsed.text.format is not None
    assert parsed.text.format.type == "json_schema"


async def test_previous_response_id_chains_and_input_items(sdk: AsyncOpenAI) -> None:
    one = await sdk.responses.create(model=MODEL, input="alpha", max_output_tokens=2)
    two = await sdk.responses.create(
        model=MODEL, input="beta gamma", previous_response_id=one.id, max_output_tokens=2
    )
    three = await sdk.responses.create(
        model=MODEL, input="delta", previous_response_id=two.id, max_output_tokens=2
    )
    assert three.usage is not None
    # alpha + 2 words answered + beta gamma + 2 words answered + delta
    assert three.usage.input_tokens == 1 + 2 + 2 + 2 + 1
    page = await sdk.responses.input_items.list(three.id, order="asc")
    items = [item.model_dump(exclude_none=True) for item in page.data]
    assert [item["type"] for item in items] == ["message"] * 5
    assert [item["role"] for item in items] == ["user", "assistant"] * 2 + ["user"]
    assert items[0]["content"][0] == {"type": "input_text", "text": "alpha"}
    assert len({item["id"] for item in items}) == 5
    newest = await sdk.responses.input_items.list(three.id, limit=2)
    assert [item.id for item in newest.data] == [items[4]["id"], items[3]["id"]]
    assert newest.has_more is True
    raw = await sdk.get(
        f"/responses/{three.id}/input_items",
        cast_to=dict[str, Any],
        options={"params": {"limit": 2}},
    )
    assert REQUIRED["ResponseItemList"] <= raw.keys()
    rest = await sdk.responses.input_items.list(three.id, after=items[3]["id"])
    assert [item.id for item in rest.data] == [i["id"] for i in reversed(items[:3])]


async def test_retrieve_and_delete(sdk: AsyncOpenAI) -> None:
    made = await sdk.responses.create(model=MODEL, input="keep me")
    got = await sdk.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    await sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.create(model=MODEL, input="more", previous_response_id=made.id)


async def test_store_false_is_not_kept(sdk: AsyncOpenAI) -> None:
    made = await sdk.responses.create(model=MODEL, input="forget me", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(made.id)


async def test_another_key_cannot_read_a_response(
    stack: Stack, sdk: AsyncOpenAI, keys: dict[str, str]
) -> None:
    made = await sdk.responses.create(model=MODEL, input="mine")
    async with AsyncOpenAI(base_url=stack.api_url, api_key=keys["b"], max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.input_items.list(made.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError) as info:
            await other.responses.create(model=MODEL, input="x", previous_response_id=made.id)
        assert info.value.param == "previous_response_id"  # type: ignore[attr-defined]
    assert (await sdk.responses.retrieve(made.id)).id == made.id


async def test_what_is_not_supported_is_a_400_in_openai_s_shape(sdk: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.create(
            model=MODEL,
            input="x",
            tools=[{"type": "web_search"}],
            tool_choice={"type": "web_search"},  # type: ignore[typeddict-item]
        )
    assert info.value.param == "tool_choice"  # type: ignore[attr-defined]
    assert "web_search" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.create(model=MODEL, input="x", max_output_tokens=2**31)
    assert info.value.param == "max_output_tokens"  # type: ignore[attr-defined]
    assert "max_output_tokens" in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.responses.create(model="nope", input="x")
    assert info.value.code == "model_not_found"


async def test_a_request_shaped_as_codex_sends_it(stack: Stack, keys: dict[str, str]) -> None:
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }
    body = {
        "model": MODEL,
        "instructions": "You are a coding agent running in the Codex CLI.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            for text in ("<environment_context>cwd</environment_context>", "list files")
        ],
        "tools": [shell],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0193-session",
        "text": {"verbosity": "medium"},
    }  # fmt: skip
    events = await sse(stack, keys["a"], body)
    check_events(events)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    call = final["output"][-1]
    assert call["type"] == "function_call"
    assert call["name"] == "shell"
    assert isinstance(json.loads(call["arguments"])["command"], list)
    # Codex's next turn: its own items back (store is false), with the tool's output.
    body["input"] = [
        *body["input"],
        *final["output"],
        {"type": "function_call_output", "call_id": call["call_id"], "output": "README.md"},
    ]
    events = await sse(stack, keys["a"], body)
    check_events(events)
    assert events[-1]["response"]["output"][-1]["type"] == "message"


async def post(
    stack: Stack, key: str, body: dict[str, Any]
) -> tuple[dict[str, str], dict[str, Any] | list[dict[str, Any]]]:
    """The answer's headers and its body: the Response, or a stream's events."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.api_url}/responses", json=body, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            raw = (await reply.read()).decode()
            answer_headers = {k.lower(): v for k, v in reply.headers.items()}
    if not body.get("stream"):
        return answer_headers, json.loads(raw)
    events = [json.loads(frame.split("data: ", 1)[1]) for frame in raw.split("\n\n") if frame]
    return answer_headers, events


async def test_codex_0171_s_captured_request_succeeds_streamed_and_not(
    stack: Stack, keys: dict[str, str]
) -> None:
    """The request Codex CLI 0.171 sent to this stack and got a 400 for (texts trimmed,
    every tool kept: function, namespace and web_search), now answered; then its next
    turn, with the items it got back and the tool's output."""
    body = json.loads(CODEX_REQUEST.read_text())
    body["model"] = MODEL
    headers, events = await post(stack, keys["a"], body)
    assert headers["x-iop-dropped-tools"] == "web_search"
    assert isinstance(events, list)
    check_events(events)
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["prompt_cache_key"] == body["prompt_cache_key"]
    assert {tool["type"] for tool in final["tools"]} == {"function", "namespace"}
    call = final["output"][-1]
    assert (call["type"], call["name"]) == ("function_call", "exec_command")
    body["input"] = [
        *body["input"],
        *final["output"],
        {"type": "function_call_output", "call_id": call["call_id"], "output": "README.md"},
    ]
    headers, events = await post(stack, keys["a"], body)
    assert isinstance(events, list)
    check_events(events)
    assert events[-1]["response"]["output"][-1]["type"] == "message"
    headers, response = await post(stack, keys["a"], {**body, "stream": False})
    assert isinstance(response, dict)
    assert headers["x-iop-dropped-tools"] == "web_search"
    check_response(response)


async def test_a_namespaced_function_and_a_custom_tool_round_trip(
    stack: Stack, keys: dict[str, str]
) -> None:
    codex = json.loads(CODEX_REQUEST.read_text())
    agents = next(tool for tool in codex["tools"] if tool["type"] == "namespace")
    patch = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files with a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
    }
    body: dict[str, Any] = {
        "model": MODEL,
        "input": "spawn one",
        "tools": [agents, patch],
        "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": agents["name"]},
        "store": False,
        "stream": True,
    }
    _, events = await post(stack, keys["a"], body)
    assert isinstance(events, list)
    check_events(events)
    call = events[-1]["response"]["output"][-1]
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
    body["tool_choice"] = {"type": "custom", "name": "apply_patch"}
    _, events = await post(stack, keys["a"], body)
    assert isinstance(events, list)
    check_events(events)
    custom = events[-1]["response"]["output"][-1]
    assert custom["type"] == "custom_tool_call"
    assert custom["id"].startswith("ctc_")
    assert isinstance(custom["input"], str)
    kinds = [event["type"] for event in events]
    assert "response.custom_tool_call_input.done" in kinds
    body["input"] = [
        {"type": "message", "role": "user", "content": "spawn one"},
        custom,
        {"type": "custom_tool_call_output", "call_id": custom["call_id"], "output": "applied"},
    ]
    body["tool_choice"] = "auto"
    body["stream"] = False
    _, response = await post(stack, keys["a"], body)
    assert isinstance(response, dict)
    check_response(response)
    assert response["output"][-1]["type"] == "message"  # after a tool result, text


async def test_every_echoed_field_is_the_request_s(sdk: AsyncOpenAI, stack: Stack) -> None:
    body = {
        "model": MODEL,
        "input": "x",
        "prompt_cache_key": "session-1",
        "safety_identifier": "user-hash",
        "metadata": {"k": "v"},
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "max_tool_calls": 3,
        "top_logprobs": 0,
        "service_tier": "auto",
        "client_metadata": {"x-codex-turn-metadata": "{}"},  # Codex's own, accepted
        "parallel_tool_calls": True,
    }
    _, response = await post(stack, str(sdk.api_key), body)
    assert isinstance(response, dict)
    check_response(response)
    for name in (
        "prompt_cache_key",
        "safety_identifier",
        "metadata",
        "presence_penalty",
        "frequency_penalty",
        "max_tool_calls",
    ):
        assert response[name] == body[name], name
    assert response["service_tier"] == "default"  # the tier that served it
    assert response["completed_at"] >= response["created_at"]


async def test_the_openai_agents_sdk_runs_an_agent_with_a_tool(
    stack: Stack, keys: dict[str, str]
) -> None:
    from agents import (
        Agent,
        OpenAIProvider,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    async with AsyncOpenAI(base_url=stack.api_url, api_key=keys["a"], max_retries=0) as client:
        agent = Agent(
            name="assistant",
            instructions="Answer briefly.",
            model=OpenAIResponsesModel(model=MODEL, openai_client=client),
            tools=[get_weather],
        )
        result = await Runner.run(agent, "What is the weather in Paris?")
        assert len(asked) == 1  # the mock called the tool once, then answered in text
        assert isinstance(result.final_output, str)
        assert result.final_output
        # The SDK's default model provider (OpenAIProvider: the Responses API) on our client.
        default = RunConfig(model_provider=OpenAIProvider(openai_client=client))
        plain = Agent(name="plain", model=MODEL)
        result = await Runner.run(plain, "hello", run_config=default)
        assert isinstance(result.final_output, str)
        assert result.final_output
        made = result.raw_responses[-1].response_id  # None had it used chat completions
        assert made is not None
        assert (await client.responses.retrieve(made)).output_text == result.final_output
        streamed = Runner.run_streamed(plain, "hello", run_config=default)
        async for _ in streamed.stream_events():
            pass
        assert isinstance(streamed.final_output, str)
        assert streamed.final_output


async def test_langchain_chat_openai_with_the_responses_api(
    stack: Stack, keys: dict[str, str]
) -> None:
    from langchain_openai import ChatOpenAI

    async with httpx.AsyncClient() as http:  # closed here, not left to the garbage collector
        llm = ChatOpenAI(
            model=MODEL,
            base_url=stack.api_url,
            api_key=keys["a"],  # type: ignore[arg-type]
            use_responses_api=True,
            max_retries=0,
            http_async_client=http,
        )
        await check_langchain(llm)


async def check_langchain(llm: Any) -> None:
    answer = await llm.ainvoke("say something")
    assert answer.text
    chunks = [chunk async for chunk in llm.astream("stream something")]
    assert "".join(chunk.text for chunk in chunks)

    def add(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    called = await llm.bind_tools([add]).ainvoke("what is 2 + 3?")
    assert [call["name"] for call in called.tool_calls] == ["add"]
    assert set(called.tool_calls[0]["args"]) == {"a", "b"}
