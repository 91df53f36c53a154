"""What a key stores is capped and ends: the storage quota and expiry, over HTTP.

Against a real stack whose edge has small limits (``storage`` settings): stored
responses past the key's quota are refused before they run (400
``storage_quota_exceeded``), ``store: false`` still runs, and deleting makes room;
an upload past the file quota is refused; a stored response and a file are a 404
once they expire. On the code before this, nothing was capped and nothing expired.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "mock-small"
RESPONSES_QUOTA = 40_000
FILES_QUOTA = 3_000
TTL_S = 4
STORAGE = {
    "responses_quota_bytes": RESPONSES_QUOTA,
    "files_quota_bytes": FILES_QUOTA,
    "responses_ttl_s": TTL_S,
    "files_ttl_s": TTL_S,
    "sweep_interval_s": 1,
}


MOCK = {
    "type": "mock",
    "category": "local_inference",
    "capacity": 2,
    "max_queue": 4,
    "queue_timeout_ms": 5_000,
    "request_timeout_ms": 20_000,
    "tokens_per_second": 200,
}
FLEET: dict[str, object] = {
    "models": [{"id": MODEL, "providers": {"node-a-mock": "small-a", "node-b-mock": "small-b"}}],
    "nodes": [
        {"id": "node-a", "providers": [{**MOCK, "id": "node-a-mock", "models": ["small-a"]}]},
        {"id": "node-b", "providers": [{**MOCK, "id": "node-b-mock", "models": ["small-b"]}]},
    ],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    root = Path(tmp_path_factory.mktemp("storage"))
    async with start_stack_factory(root, FLEET, {"storage": STORAGE}) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def respond(http: aiohttp.ClientSession, stack: Any, **extra: Any) -> tuple[int, Any]:
    body = {"model": MODEL, "input": "x" * 10_000, "max_output_tokens": 4, **extra}
    async with http.post(f"{stack.api_url}/responses", json=body) as reply:
        return reply.status, await reply.json()


async def upload(http: aiohttp.ClientSession, stack: Any, size: int) -> tuple[int, Any]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"x" * size, filename="in.jsonl")
    async with http.post(f"{stack.api_url}/files", data=form) as reply:
        return reply.status, await reply.json()


async def test_stored_responses_and_files_expire(stack: Any, http: aiohttp.ClientSession) -> None:
    status, answer = await respond(http, stack)
    assert status == 200, answer
    response_url = f"{stack.api_url}/responses/{answer['id']}"
    status, file = await upload(http, stack, 1_000)
    assert status == 200, file
    file_url = f"{stack.api_url}/files/{file['id']}"
    for url in (response_url, file_url):
        async with http.get(url) as reply:
            assert reply.status == 200  # there, until it expires
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(30):  # TTL_S, then the next whole second
        for url in (response_url, file_url):
            while True:
                async with http.get(url) as reply:
                    if reply.status == 404:
                        break
                await asyncio.sleep(0.2)
    async with http.get(f"{stack.api_url}/files") as reply:
        assert (await reply.json())["data"] == []  # out of lists too
    print(f"\n[storage limits] a response and a file: 404 {loop.time() - started:.1f}s later")


async def test_a_key_s_stored_responses_and_files_are_capped(
    stack: Any, http: aiohttp.ClientSession
) -> None:
    # The expired response above still counts until the sweep removes it (an hour on).
    stored: list[str] = []
    refused: Any = None
    for _ in range(10):
        status, answer = await respond(http, stack)
        if status != 200:
            refused = (status, answer)
            break
        stored.append(answer["id"])
    print(f"\n[storage limits] {len(stored)} more responses of 10 KB stored, then {refused}")
    assert refused is not None, "the quota never refused a store"
    assert refused[0] == 400
    assert refused[1]["error"]["code"] == "storage_quota_exceeded"
    assert 1 <= len(stored) <= 3  # 40,000 bytes: about three such turns in all
    status, answer = await respond(http, stack, store=False)
    assert status == 200, answer  # not stored: not refused
    async with http.delete(f"{stack.api_url}/responses/{stored[-1]}") as reply:
        assert reply.status == 200
    status, answer = await respond(http, stack)
    assert status == 200, answer  # the deletion made room

    status, answer = await upload(http, stack, 2_000)
    assert status == 200, answer
    status, answer = await upload(http, stack, 2_000)
    assert (status, answer["error"]["code"]) == (400, "storage_quota_exceeded")
