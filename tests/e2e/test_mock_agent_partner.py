"""The mock as a coding agent's test partner, through the whole stack (control-plane,
edge, two mock nodes) and the official SDKs: a turn ends as an agent expects.

Each API is driven the way an agent drives it: a large output budget (Claude Code asks
32,000, Codex none, ``responses.create`` 256), tools offered, the user's prompt. The
mock calls a tool (the one the prompt names) with arguments valid for its schema, and
once the tool's result comes back it answers in text and ends the turn: ``stop``,
``end_turn``, ``completed``, never a length cut that the agent would continue. The
Responses and Messages requests reach the mock as chat completions (the edge's
translation), streamed and not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import pytest_asyncio
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # the `stack` fixture of conftest.py (a conftest cannot be imported)
MODEL = "mock-small"
AGENT_TOOLS = json.loads(
    (Path(__file__).parents[2] / "services/node/tests/unit/agent_tool_schemas.json").read_text()
)


def agent_tool(agent: str, name: str) -> dict[str, Any]:
    return next(t["schema"] for t in AGENT_TOOLS if (t["agent"], t["tool"]) == (agent, name))


# Claude Code's Bash and Read, opencode's bash (zod's bounds), Codex's exec_command.
BASH = agent_tool("claude-code", "Bash")
READ = agent_tool("claude-code", "Read")
OPENCODE_BASH = agent_tool("opencode", "bash")
EXEC = agent_tool("codex", "exec_command")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
    async with aiohttp.ClientSession() as http, asyncio.timeout(15):
        while True:  # both mocks available, so either may answer
            async with http.get(url) as response:
                rows = (await response.json())["data"] if response.status == 200 else []
            ready = {r["provider_id"] for r in rows if r["health"] == "available"}
            if {"node-a-mock", "node-b-mock"} <= ready:
                break
            await asyncio.sleep(0.1)
    async with AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def claude(stack: Stack, sdk: AsyncOpenAI) -> AsyncIterator[AsyncAnthropic]:
    root = str(stack.api_url).removesuffix("/v1")
    async with AsyncAnthropic(base_url=root, api_key="unused", max_retries=0) as client:
        yield client


def chat_tools() -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": "Read", "parameters": READ}},
        {"type": "function", "function": {"name": "bash", "parameters": OPENCODE_BASH}},
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_a_tool_round_trip_ends_with_stop(sdk: AsyncOpenAI, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": "List the files with bash."}]
    tools: Any = chat_tools()
    if stream:
        chunks = [
            chunk
            async for chunk in await sdk.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, max_tokens=4096, stream=True
            )
        ]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [call for d in deltas for call in d.tool_calls or []]
        name = calls[0].function.name if calls[0].function else None
        call_id = calls[0].id
        arguments = "".join(c.function.arguments or "" for c in calls if c.function)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        answer = await sdk.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, max_tokens=4096
        )
        [call] = answer.choices[0].message.tool_calls or []
        assert call.type == "function"
        name, call_id, arguments = call.function.name, call.id, call.function.arguments
        finish = answer.choices[0].finish_reason
    assert finish == "tool_calls"
    assert name == "bash"  # the tool the prompt names
    assert json.loads(arguments) == {"command": "echo iop-mock"}
    jsonschema.validate(json.loads(arguments), OPENCODE_BASH)
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "iop-mock"},
    ]
    after = await sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=4096
    )
    assert after.choices[0].finish_reason == "stop"
    assert after.choices[0].message.content
    assert not after.choices[0].message.tool_calls


async def test_chat_fill_asks_for_the_old_length_cut(sdk: AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=40,
        extra_body={"iop_mock": {"fill": True}},
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 40


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_a_tool_round_trip_ends_with_end_turn(
    claude: AsyncAnthropic, stream: bool
) -> None:
    """As Claude Code: max_tokens 32,000 (streamed), its Bash and Read tools, reminders
    before the prompt, the tool result sent back with a text block beside it."""
    tools: Any = [
        {"name": "Bash", "description": "Run a command.", "input_schema": BASH},
        {"name": "Read", "description": "Read a file.", "input_schema": READ},
    ]
    prompt: Any = {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>Today is a day.</system-reminder>"},
            {"type": "text", "text": "Run Bash to list the files."},
        ],
    }

    async def create(messages: list[Any]) -> Any:
        if not stream:  # the SDK wants a stream for 32,000: a large budget all the same
            return await claude.messages.create(
                model=MODEL, max_tokens=8_192, tools=tools, messages=messages
            )
        async with claude.messages.stream(
            model=MODEL, max_tokens=32_000, tools=tools, messages=messages
        ) as events:
            return await events.get_final_message()

    first = await create([prompt])
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "Bash"
    assert call.input == {"command": "echo iop-mock"}
    jsonschema.validate(call.input, BASH)
    result: Any = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "iop-mock"},
            {"type": "text", "text": "<system-reminder>Keep going.</system-reminder>"},
        ],
    }
    after = await create([prompt, {"role": "assistant", "content": first.content}, result])
    assert after.stop_reason == "end_turn"
    assert [block.type for block in after.content] == ["text"]


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_a_tool_round_trip_ends_completed(sdk: AsyncOpenAI, stream: bool) -> None:
    """As Codex: its exec_command tool, no output budget; then ``max_output_tokens=256``."""
    tools: Any = [{"type": "function", "name": "exec_command", "parameters": EXEC, "strict": False}]

    async def create(**fields: Any) -> Any:
        if not stream:
            return await sdk.responses.create(model=MODEL, tools=tools, **fields)
        async with sdk.responses.stream(model=MODEL, tools=tools, **fields) as events:
            return await events.get_final_response()

    first = await create(input="List the files.")
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "exec_command"
    assert json.loads(call.arguments) == {"cmd": "echo iop-mock"}
    follow: Any = [
        {"type": "message", "role": "user", "content": "List the files."},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "iop-mock"},
    ]
    after = await create(input=follow, max_output_tokens=256)
    assert after.status == "completed"
    assert after.incomplete_details is None
    assert after.output_text


async def test_responses_a_plain_answer_with_a_budget_is_completed(sdk: AsyncOpenAI) -> None:
    answer = await sdk.responses.create(model=MODEL, input="Say hi.", max_output_tokens=256)
    assert answer.status == "completed"
    assert answer.output_text.split()[:4] == ["the", "quick", "brown", "fox"]
