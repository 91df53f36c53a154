"""Cache affinity on a real stack (docs/ARCHITECTURE.md#cache-affinity): an agent's
session stays on the provider that served its first turn, through that node's restart,
moves once when the node is gone, and stays where it moved.

Two nodes, one mock provider each, behind one model. The seed's rule alone would send
every turn of an idle pool to the provider listed first (node-a's); the session is
placed on node-b's by keeping node-a's busy during its first turn, so each later turn
that lands on node-b's is the affinity's doing. Which provider served a turn is read
where an operator reads it: the edge's run log (``/iop/v1/runs``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

SYSTEM = "You are a coding agent working in a large repository. " * 40  # ~2 KB: 8 blocks


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 1,
        "max_queue": 4,
        "queue_timeout_ms": 10_000,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 100,
    }


FLEET: dict[str, object] = {
    "models": [{"id": "pool", "providers": {"a-mock": "served-a", "b-mock": "served-b"}}],
    "nodes": [
        {"id": "node-a", "providers": [mock("a-mock", "served-a")]},
        {"id": "node-b", "providers": [mock("b-mock", "served-b")]},
    ],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(tmp_path_factory.mktemp("affinity"), FLEET) as running:
        yield running


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await asyncio.sleep(0.1)


async def turn(stack: Any, session: str | None, turns: int, hold_ms: int = 0) -> dict[str, Any]:
    """One turn of the session's growing conversation (its provider busy ``hold_ms`` before
    answering); the answer's JSON."""
    messages = [{"role": "system", "content": SYSTEM}]
    for number in range(turns):
        messages.append({"role": "user", "content": f"step {number}: look at file {number}.py"})
        messages.append({"role": "assistant", "content": f"done with step {number}"})
    messages.append({"role": "user", "content": "next"})
    headers = {"x-session-id": session} if session else {}
    body: dict[str, Any] = {"model": "pool", "messages": messages, "max_tokens": 4}
    if hold_ms:
        body["iop_mock"] = {"delay_ms": hold_ms}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{stack.api_url}/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


async def served_by(stack: Any, completion_id: str) -> str:
    """The provider the run log names for the run of this answer."""
    run_id = completion_id.removeprefix("chatcmpl-")
    url = stack.api_url.replace("/v1", "/iop/v1/runs") + "?limit=50"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        rows = (await response.json())["data"]
    found = [row["provider_id"] for row in rows if row["run_id"] == run_id]
    assert found, (run_id, rows[:3])
    return str(found[0])


async def test_a_session_stays_through_a_restart_and_moves_once_on_failover(stack: Any) -> None:
    # node-a's provider is busy with a long answer while the session's first turn comes.
    hold = asyncio.create_task(turn(stack, "someone-else", 0, hold_ms=3000))
    await asyncio.sleep(0.5)
    first = await turn(stack, "agent-1", 0)
    assert await served_by(stack, first["id"]) == "b-mock"
    await hold

    # An idle pool: the seed's rule would pick a-mock; the session goes back to b-mock.
    for number in range(1, 4):
        answer = await turn(stack, "agent-1", number)
        assert await served_by(stack, answer["id"]) == "b-mock"
    # Another session, new to the edge, goes the seed's way.
    other = await turn(stack, "agent-2", 0)
    assert await served_by(stack, other["id"]) == "a-mock"

    # node-b restarts: the session is still placed there (the edge's record survives).
    await stack.stop("node-b")
    await stack.start("node-b")
    await stack.wait_registered(("node-b",))
    answer = await turn(stack, "agent-1", 4)
    assert await served_by(stack, answer["id"]) == "b-mock"

    # node-b is gone: the session fails over to a-mock, and stays there once b is back.
    await stack.stop("node-b")

    async def b_gone() -> bool:
        url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            rows = (await response.json())["data"]
        return not any(row["connected"] for row in rows if row["provider_id"] == "b-mock")

    await eventually(b_gone)
    answer = await turn(stack, "agent-1", 5)
    assert await served_by(stack, answer["id"]) == "a-mock"
    await stack.start("node-b")
    await stack.wait_registered(("node-b",))
    answer = await turn(stack, "agent-1", 6)
    assert await served_by(stack, answer["id"]) == "a-mock"


async def test_without_a_session_the_prompt_s_prefix_steers_the_turn(stack: Any) -> None:
    hold = asyncio.create_task(turn(stack, "holder", 0, hold_ms=3000))
    await asyncio.sleep(0.5)
    # No session header: the same conversation, recognised by its prefix.
    first = await turn(stack, None, 10)
    placed = await served_by(stack, first["id"])
    await hold
    answer = await turn(stack, None, 11)
    assert await served_by(stack, answer["id"]) == placed
