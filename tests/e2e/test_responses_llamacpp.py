"""The Responses API on the real llama.cpp model (SmolLM2-135M), through ``make run``'s stack.

The stack is started the way ``test_local_stack`` starts it (that module's
``local_stack``, loaded from its file). SmolLM2's text varies between runs: only
shapes, ids, statuses, usage and the event order are checked, never content.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"iop_e2e_{name}", HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


local = _load("test_local_stack")
contract = _load("test_responses_api")
certs = local.certs  # the fixture, under this module's name
LLAMA = local.LLAMA_MODEL


async def sse(api: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{api}/responses", json=body) as reply:
            assert reply.status == 200, await reply.text()
            raw = (await reply.read()).decode()
    events = []
    for frame in filter(None, raw.split("\n\n")):
        head, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    return events


async def check_create(sdk: AsyncOpenAI) -> None:
    response = await sdk.responses.create(
        model=LLAMA, instructions="Answer briefly.", input="Say hello.", max_output_tokens=8
    )
    contract.check_response(response.model_dump(), wire=False)
    assert response.model == LLAMA
    assert response.status in {"completed", "incomplete"}
    assert response.output_text
    assert response.usage is not None
    assert 0 < response.usage.output_tokens <= 8
    assert response.usage.input_tokens > 0
    follow = await sdk.responses.create(
        model=LLAMA,
        previous_response_id=response.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Again."}]}],
        max_output_tokens=8,
    )
    contract.check_response(follow.model_dump(), wire=False)
    assert follow.usage is not None
    assert follow.usage.input_tokens > response.usage.input_tokens  # the chain was sent
    items = await sdk.responses.input_items.list(follow.id, order="asc")
    assert [item.type for item in items.data] == ["message"] * 3


async def check_stream(sdk: AsyncOpenAI) -> None:
    deltas: list[str] = []
    final: Any = None
    async with sdk.responses.stream(
        model=LLAMA, input="Count to three.", max_output_tokens=8
    ) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                # (the SDK's get_final_response() knows only response.completed, and
                # SmolLM2 may well run to max_output_tokens)
                final = event.response
    assert len(deltas) > 1  # an event per token, not one blob
    assert final is not None
    assert final.output_text == "".join(deltas)
    assert final.usage is not None
    assert 0 < final.usage.output_tokens <= 8  # llama.cpp's usage, from its last chunk
    contract.check_response(final.model_dump(), wire=False)


async def check_tool_round_trip(sdk: AsyncOpenAI) -> None:
    """Tools offered with tool_choice required, then the tool's output in the next request,
    chained by previous_response_id. ``make run``'s llama.cpp (Jinja templates on, but
    SmolLM2's own template has no tool syntax) ignores tools and answers in text, as it
    does on chat completions: the round trip is checked with whatever it answered."""
    tools: Any = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "strict": False,
        }
    ]
    first = await sdk.responses.create(
        model=LLAMA,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=32,
    )
    contract.check_response(first.model_dump(), wire=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls or [item.type for item in first.output] == ["message"]
    follow: Any = (
        [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
        if calls
        else "It is sunny."
    )
    second = await sdk.responses.create(
        model=LLAMA, previous_response_id=first.id, input=follow, tools=tools, max_output_tokens=8
    )
    contract.check_response(second.model_dump(), wire=False)
    assert second.previous_response_id == first.id


async def check_agents_and_langchain(api: str) -> None:
    import httpx
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from langchain_openai import ChatOpenAI

    set_tracing_disabled(True)
    async with AsyncOpenAI(base_url=api, api_key="unused", max_retries=0) as client:
        # Greedy, so that SmolLM2 answers the same way every run: sampled, it now and then
        # runs to the output cap, and the SDK raises on `response.incomplete`.
        agent = Agent(
            name="a",
            model=OpenAIResponsesModel(model=LLAMA, openai_client=client),
            model_settings=ModelSettings(temperature=0.0),
        )
        result = await Runner.run(agent, "Say hello.")
        assert isinstance(result.final_output, str)
    async with httpx.AsyncClient() as http:
        llm = ChatOpenAI(
            model=LLAMA,
            base_url=api,
            api_key="unused",  # type: ignore[arg-type]
            use_responses_api=True,
            max_retries=0,
            http_async_client=http,
            max_tokens=8,  # type: ignore[call-arg]
        )
        answer = await llm.ainvoke("Say hello.")
        assert answer.response_metadata.get("status") in {"completed", "incomplete"}


async def check_codex_shaped_stream(api: str) -> None:
    events = await sse(
        api,
        {
            "model": LLAMA,
            "instructions": "You are a coding agent.",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                }
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "shell",
                    "description": "Runs a command.",
                    "strict": False,
                    "parameters": {
                        "type": "object",
                        "properties": {"command": {"type": "string"}},
                        "required": ["command"],
                    },
                },
                {
                    "type": "namespace",
                    "name": "multi_agent_v1",
                    "description": "Sub-agents.",
                    "tools": [
                        {
                            "type": "function",
                            "name": "spawn_agent",
                            "parameters": {
                                "type": "object",
                                "properties": {"message": {"type": "string"}},
                            },
                        }
                    ],
                },
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"},
                },
                {"type": "web_search", "external_web_access": False},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "session",
            "client_metadata": {"x-codex-installation-id": "test"},
            "max_output_tokens": 16,
        },
    )
    contract.check_events(events)
    assert events[-1]["type"] in {"response.completed", "response.incomplete"}
    final = events[-1]["response"]
    assert [tool["type"] for tool in final["tools"]] == ["function", "namespace", "custom"]
    for item in final["output"]:  # whatever SmolLM2 chose, named as the client defined it
        if item["type"] == "function_call":
            assert item["name"] in {"shell", "spawn_agent"}
            assert ("namespace" in item) == (item["name"] == "spawn_agent")
        elif item["type"] == "custom_tool_call":
            assert item["name"] == "apply_patch"


@pytest.mark.timeout(240)
async def test_the_responses_api_on_llamacpp(tmp_path: Path, certs: Path) -> None:
    if (reason := local.missing_llamacpp()) is not None:
        pytest.skip(f"the real llama.cpp provider cannot run: {reason}")
    async with local.local_stack(tmp_path, certs) as (running, up):
        async with AsyncOpenAI(base_url=up["api"], api_key="unused", max_retries=0) as sdk:
            await check_create(sdk)
            await check_stream(sdk)
            await check_tool_round_trip(sdk)
        await check_agents_and_langchain(up["api"])
        await check_codex_shaped_stream(up["api"])
        assert await running.stop() == 0, running.output
