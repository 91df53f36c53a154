"""Coding agents, unchanged, against ``make run``'s stack: Codex CLI (over SSE and over
WebSocket), Claude Code, opencode, Continue CLI and aider.

Each agent runs one non-interactive turn through a recording relay (``recorder.py``), so
the test holds both what the agent did (its exit code) and what it sent (every request):
- on ``mock-small``, a turn with a tool round trip: the mock calls the tool named in the
  prompt, the agent runs it and sends the result back, the mock answers, the agent exits 0;
- on ``smollm2:135m`` (the real llama.cpp, 8,192 tokens of context), a plain turn where the
  agent's own first request fits; where it cannot (Claude Code's is about 19,000 tokens),
  ``context_length_exceeded`` in its API's shape at once, and the agent stops with that
  message instead of retrying or compacting in a loop.

``AGENTS_RECORD=1`` writes the requests each agent sent into ``requests/<agent>.json``:
the fixtures the contract tests (``tests/e2e/test_agent_requests.py``) replay in plain
``make test``, where no agent is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(600),  # the stack comes up once, then a turn may take minutes on a CPU
]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


agents = _load(HERE / "agents.py", "iop_agents_agents")
recorder = _load(HERE / "recorder.py", "iop_agents_recorder")
local = _load(REPO / "tests" / "e2e" / "test_local_stack.py", "iop_agents_local_stack")

MOCK = "mock-small"
LLAMA = local.LLAMA_MODEL
TURN_TIMEOUT_S = 480.0  # a turn on the real model: a long prompt's prefill on one CPU thread
REQUIRED = os.environ.get("TEST_AGENTS_REQUIRED") == "1"
RECORD = os.environ.get("AGENTS_RECORD") == "1"
# Agents whose own first request is larger than SmolLM2's 8,192 tokens of context.
TOO_LONG_FOR_LLAMA = {"claude"}


def _require(agent: Any) -> None:
    why = agent.missing()
    if why is None:
        return
    if REQUIRED:
        pytest.fail(f"{agent.name}: {why} (make test-agents requires every agent)")
    pytest.skip(why)


async def _turn(agent: Any, origin: str, model: str, tmp_path: Path) -> tuple[Any, list[Any]]:
    async with recorder.recording(origin) as relay:
        work = agents.workdir(tmp_path / "work")
        turn = await agent.run(tmp_path / "home", work, relay.url, model, TURN_TIMEOUT_S)
    return turn, relay.posts(f"/v1/{agent.api}" if agent.api != "chat" else "/v1/chat")


def _describe(turn: Any, posts: list[Any]) -> str:
    lines = [f"rc={turn.returncode} after {turn.seconds:.1f}s", turn.output[-3000:]]
    for post in posts:
        lines.append(f"{post.method} {post.path} -> {post.status}: {post.answer[:600]!r}")
        for sent in post.socket_messages:
            lines.append(f"  socket <- {sent[:300]}")
        for reply in post.socket_replies:
            lines.append(f"  socket -> {reply[:300]}")
    return "\n".join(lines)


def _tool_names(api: str, body: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for tool in body.get("tools") or []:
        if api == "chat":
            names.add(tool["function"]["name"])
        else:
            names.add(tool.get("name", ""))
    return names


def _carries_tool_result(api: str, body: dict[str, Any]) -> bool:
    if api == "responses":
        return any(
            item.get("type") in {"function_call_output", "custom_tool_call_output"}
            for item in body.get("input") or []
            if isinstance(item, dict)
        )
    if api == "messages":
        return any(
            isinstance(block, dict) and block.get("type") == "tool_result"
            for message in body["messages"]
            if isinstance(message.get("content"), list)
            for block in message["content"]
        )
    return any(message.get("role") == "tool" for message in body["messages"])


def _called_tools(api: str, body: dict[str, Any]) -> set[str]:
    """The names of the tool calls in the conversation the agent sent back."""
    if api == "responses":
        return {
            item.get("name", "")
            for item in body.get("input") or []
            if isinstance(item, dict) and item.get("type") == "function_call"
        }
    if api == "messages":
        return {
            block.get("name", "")
            for message in body["messages"]
            if message.get("role") == "assistant" and isinstance(message.get("content"), list)
            for block in message["content"]
            if isinstance(block, dict) and block.get("type") == "tool_use"
        }
    return {
        call["function"]["name"]
        for message in body["messages"]
        if message.get("role") == "assistant"
        for call in message.get("tool_calls") or ()
    }


def _bodies(posts: list[Any]) -> list[dict[str, Any]]:
    """Each request body (a WebSocket session: each ``response.create`` on it)."""
    bodies: list[dict[str, Any]] = []
    for post in posts:
        if post.socket_messages:
            bodies += [json.loads(m) for m in post.socket_messages]
        elif post.body:
            bodies.append(post.json)
    return bodies


def _record(agent: Any, model: str, posts: list[Any]) -> None:
    if not RECORD:
        return
    target = HERE / "requests" / f"{agent.name}.json"
    target.parent.mkdir(exist_ok=True)
    existing = json.loads(target.read_text()) if target.exists() else {}
    existing["version"] = agent.version
    existing[model] = [post.as_record() for post in posts]
    target.write_text(json.dumps(existing, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("agent", agents.AGENTS, ids=lambda a: a.name)
async def test_a_turn_with_a_tool_round_trip_on_the_mock(
    agent: Any, origin: str, tmp_path: Path
) -> None:
    _require(agent)
    turn, posts = await _turn(agent, origin, MOCK, tmp_path)
    _record(agent, MOCK, posts)
    described = _describe(turn, posts)
    assert turn.returncode == 0, described
    assert posts, described
    assert all(post.status in {101, 200} for post in posts), described
    bodies = _bodies(posts)
    if agent.tool is None:
        return
    assert agent.tool in _tool_names(agent.api, bodies[0]) or any(
        agent.tool in _tool_names(agent.api, body) for body in bodies
    ), described
    assert any(_carries_tool_result(agent.api, body) for body in bodies), (
        "the agent never sent a tool result back:\n" + described
    )
    # The mock called the tool the prompt named, and the agent ran that one.
    assert any(agent.tool in _called_tools(agent.api, body) for body in bodies), described


@pytest.mark.parametrize("agent", agents.AGENTS, ids=lambda a: a.name)
async def test_a_plain_turn_on_the_real_model(agent: Any, origin: str, tmp_path: Path) -> None:
    _require(agent)
    turn, posts = await _turn(agent, origin, LLAMA, tmp_path)
    _record(agent, LLAMA, posts)
    described = _describe(turn, posts)
    assert posts, described
    if agent.name not in TOO_LONG_FOR_LLAMA:
        assert turn.returncode == 0, described
        assert all(post.status in {101, 200} for post in posts), described
        return
    # Its first request cannot fit 8,192 tokens: told so at once, in its API's shape, and
    # it stops with the message instead of compacting or retrying in a loop.
    first = posts[0]
    assert first.status == 400, described
    error = json.loads(first.answer)
    if agent.api == "messages":
        assert error["type"] == "error", described
        assert error["error"]["type"] == "invalid_request_error", described
        assert error["error"]["message"].startswith("prompt is too long"), described
    else:
        assert error["error"]["code"] == "context_length_exceeded", described
    assert len(posts) <= 3, described
    assert turn.returncode != 0, described
    assert "too long" in turn.output or "context" in turn.output, described
