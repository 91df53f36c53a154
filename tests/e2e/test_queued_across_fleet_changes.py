"""Requests waiting in a model's queue while the fleet changes under them, on a real stack.

A `config reload` that renames a provider's served name sends the waiting requests with
the new name (they used to go with the old one, which the node, configured anew, refused:
a 400); a node retired while requests wait for the model it alone served answers them at
once (they used to wait for their queue's timeout, then get a 503 saying no slot was
free). Each waiter is made by holding the model's one slot with a streamed request, read
until its first chunk, and let go once the change is seen where a user sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_S = 60.0  # each queue's timeout: far longer than any step here takes
ANSWER_S = 40.0  # what a waiter may take to be answered once the slot is free (< WAIT_S)


def slow(provider_id: str, served: str) -> dict[str, object]:
    """One slot, a long queue wait, 20 tokens/s: a long answer holds the slot."""
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 1,
        "max_queue": 4,
        "queue_timeout_ms": int(WAIT_S * 1000),
        "request_timeout_ms": 120_000,
        "tokens_per_second": 20,
    }


def fleet(served: str) -> dict[str, object]:
    """node-a serves `renamed` (under ``served``), node-b `b-only` alone."""
    return {
        "models": [
            {"id": "renamed", "providers": {"node-a-slow": served}},
            {"id": "b-only", "providers": {"node-b-slow": "b-slow"}},
        ],
        "nodes": [
            {"id": "node-a", "providers": [slow("node-a-slow", served)]},
            {"id": "node-b", "providers": [slow("node-b-slow", "b-slow")]},
            {"id": "node-fuzz", "providers": []},
        ],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(tmp_path_factory.mktemp("queued"), fleet("v1")) as running:
        yield running


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Poll another process's state until ``check`` holds."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await asyncio.sleep(0.1)


async def catalog(stack: Any, kind: str, key: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", f"/iop/v1/catalog/{kind}")
        async with http.get(url) as response:
            assert response.status == 200
            return {row[key]: row for row in (await response.json())["data"]}


def body(model: str, max_tokens: int, *, stream: bool = False) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
        "iop_mock": {"fill": True},  # an answer of max_tokens tokens (not a drill)
    }


@contextlib.asynccontextmanager
async def holding_the_slot(stack: Any, model: str) -> AsyncIterator[None]:
    """A streamed request with a long answer, running (its first chunk read) until the
    block ends: the client goes, the run is cancelled, and the slot is free."""
    async with aiohttp.ClientSession() as http:
        url = f"{stack.api_url}/chat/completions"
        async with http.post(url, json=body(model, 100_000, stream=True)) as response:
            assert response.status == 200
            await response.content.readline()
            yield


async def ask(stack: Any, model: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_S)) as http:
        async with http.post(f"{stack.api_url}/chat/completions", json=body(model, 4)) as answer:
            return answer.status, json.loads(await answer.read())


async def waiting(stack: Any, model: str, count: int) -> None:
    async def queued() -> bool:
        return (await catalog(stack, "models", "id"))[model]["queued"] == count

    await eventually(queued)


async def test_waiters_are_sent_with_the_served_name_of_a_reload(stack: Any) -> None:
    async with holding_the_slot(stack, "renamed"):
        waiters = [asyncio.create_task(ask(stack, "renamed")) for _ in range(2)]
        await waiting(stack, "renamed", 2)
        stack.fleet_file.write_text(yaml.safe_dump(fleet("v2")))
        await stack.control_plane_cli("config", "reload")

        async def renamed() -> bool:
            return (await catalog(stack, "providers", "provider_id"))["node-a-slow"]["models"] == [
                "v2"
            ]

        await eventually(renamed)
    answers = await asyncio.gather(*waiters)
    for status, answer in answers:
        assert status == 200, answer
        assert answer["model"] == "renamed"
        assert answer["choices"][0]["finish_reason"] == "length"


async def test_a_retired_node_s_waiters_are_answered_at_once(stack: Any) -> None:
    """node-b alone serves b-only: once it is retired nothing can serve its waiters, and
    they get a 503 saying so (not, a queue timeout later, that no slot was free)."""
    async with holding_the_slot(stack, "b-only"):
        waiter = asyncio.create_task(ask(stack, "b-only"))
        await waiting(stack, "b-only", 1)
        await stack.control_plane_cli("node", "retire", "node-b")
        status, answer = await waiter
    assert status == 503, answer
    assert answer["error"]["code"] == "no_provider_available"
    assert "has no provider any more" in answer["error"]["message"]
