"""Coding agents, unchanged, against ``make run``'s stack: Codex CLI (over SSE and over
WebSocket), Claude Code, opencode, Continue CLI and aider.

Each agent runs one non-interactive turn through a recording relay (``recorder.py``), so
the test holds both what the agent did (its exit code) and what it sent (every request):
- on ``mock-small``, a turn with a tool round trip: the mock calls the tool named in the
  prompt, the agent runs it and sends the result back, the mock answers, the agent exits 0;
- on ``smollm2:135m`` (the real llama.cpp, 8,192 tokens of context), a plain turn: every
  request served, exit 0; where the 135M model, sampling, runs on to its 512-token cap
  under Claude Code's or Codex's long prompt, the answer says so and the agent stops
  with its own message after a bounded number of requests.

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
# What an agent says when it gives up on answers cut at the model's output cap.
GIVES_UP_AT_THE_CAP = {
    "claude": "output token maximum",
    "codex": "Incomplete response returned, reason: max_output_tokens",
    "codex-ws": "Incomplete response returned, reason: max_output_tokens",
}


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
    # The mock called the tool the prompt named, and the agent ran that one. Over the
    # WebSocket, Codex sends only the new items (the call is in the socket's replies).
    called = set().union(*(_called_tools(agent.api, body) for body in bodies))
    called |= {
        event["item"]["name"]
        for post in posts
        for event in map(json.loads, post.socket_replies)
        if event["type"] == "response.output_item.done" and event["item"]["type"] == "function_call"
    }
    assert agent.tool in called, described


def _hit_the_cap(post: Any) -> bool:
    """The answer ended at the model's output cap (Messages' ``max_tokens``, Responses'
    ``incomplete`` for ``max_output_tokens``, over HTTP or on the socket)."""
    said = [post.answer, *(reply.encode() for reply in post.socket_replies)]
    marks = (b'"stop_reason":"max_tokens"', b'"reason":"max_output_tokens"')
    return any(mark in text for text in said for mark in marks)


@pytest.mark.parametrize("agent", agents.AGENTS, ids=lambda a: a.name)
async def test_a_plain_turn_on_the_real_model(agent: Any, origin: str, tmp_path: Path) -> None:
    _require(agent)
    turn, posts = await _turn(agent, origin, LLAMA, tmp_path)
    _record(agent, LLAMA, posts)
    described = _describe(turn, posts)
    assert posts, described
    assert all(post.status in {101, 200} for post in posts), described
    if turn.returncode == 0 or agent.name not in GIVES_UP_AT_THE_CAP:
        assert turn.returncode == 0, described
        return
    # SmolLM2-135M, sampling, now and then runs on to its 512-token cap under a coding
    # agent's long prompt. Every request was served and the answer says the cap was hit;
    # Claude Code resumes a bounded number of times, Codex not at all, then each stops
    # with its own message. The model's limit, not the API's.
    assert len(posts) <= 4, described
    assert _hit_the_cap(posts[-1]), described
    assert GIVES_UP_AT_THE_CAP[agent.name] in turn.output, described
