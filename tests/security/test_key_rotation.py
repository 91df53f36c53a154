"""Keys that expire, and keys rotated with an overlap, against the real stack (control-plane,
edge and a node as processes, mTLS, the CLI, the official OpenAI SDK).

- A key issued with ``--expires-in`` is served until its moment and refused from then on
  (401, a message saying it expired): the edge decides by itself, so no push is waited
  for; how long after the moment the first refusal came is printed.
- ``key rotate --overlap``: the new secret works at once, the old one until the overlap
  ends; a client moving from the old secret to the new has no request refused meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLEET: dict[str, object] = {
    "models": [{"id": "mock-small", "providers": {"node-a-mock": "small-a"}}],
    "nodes": [
        {
            "id": "node-a",
            "providers": [
                {
                    "id": "node-a-mock",
                    "type": "mock",
                    "category": "local_inference",
                    "models": ["small-a"],
                    "capacity": 4,
                    "max_queue": 4,
                    "queue_timeout_ms": 10_000,
                    "request_timeout_ms": 20_000,
                    "tokens_per_second": 500,
                }
            ],
        },
        {"id": "node-b", "providers": []},
        {"id": "node-fuzz", "providers": []},
    ],
}
GIVE_UP_S = 30.0  # a bound for a busy machine; nothing here waits for it unless broken


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(Path(tmp_path_factory.mktemp("rotation")), FLEET) as running:
        yield running


def sdk(stack: Any, secret: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0, timeout=30)


async def ask(client: AsyncOpenAI) -> None:
    await client.chat.completions.create(
        model="mock-small", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


async def listed(stack: Any, key_id: str) -> dict[str, Any]:
    keys = json.loads(await stack.control_plane_cli("key", "list", "--json"))
    [entry] = [k for k in keys if k["key_id"] == key_id]
    return dict(entry)


async def test_an_expired_key_is_refused_from_its_moment_on(stack: Any) -> None:
    secret = await stack.issue_key("short-lived", "--expires-in", "15s")
    async with sdk(stack, secret) as client:
        await expiry_is_kept(stack, client)


async def expiry_is_kept(stack: Any, client: AsyncOpenAI) -> None:
    keys = json.loads(await stack.control_plane_cli("key", "list", "--json"))
    [entry] = [k for k in keys if k["name"] == "short-lived"]
    expires = datetime.fromisoformat(entry["expires_at"]).timestamp()
    assert 0 < expires - time.time() <= 15
    served = 0
    async with asyncio.timeout(GIVE_UP_S):
        while True:
            sent = time.time()
            try:
                await ask(client)
            except openai.AuthenticationError as exc:
                refused = exc
                break
            # served: it was sent before the moment (the edge's clock is this machine's)
            assert sent < expires
            served += 1
    assert served > 0
    assert sent >= expires - 0.05  # refused only from its moment on (a clock's rounding)
    assert "expired" in refused.message
    print(f"first refusal {sent - expires:+.3f} s after the expiry; {served} served before")
    # and stays refused
    with pytest.raises(openai.AuthenticationError, match="expired"):
        await ask(client)


async def test_a_rotated_key_takes_both_secrets_during_the_overlap(stack: Any) -> None:
    old = await stack.issue_key("rotated", "--models", "mock-small")
    key_id = (await listed_by_name(stack, "rotated"))["key_id"]
    out = await stack.control_plane_cli("key", "rotate", key_id, "--overlap", "8s", "--json")
    rotated = json.loads(out)
    new = rotated["secret"]
    overlap_end = datetime.fromisoformat(rotated["previous_secret_until"]).timestamp()
    assert new != old
    assert new.startswith("sk-iop-")

    # The client keeps using the old secret until the new one is served, then moves over:
    # no request of it is refused on the way.
    async with sdk(stack, old) as old_client, sdk(stack, new) as new_client:
        await overlap_is_kept(old_client, new_client, overlap_end)
    entry = await listed(stack, key_id)
    assert entry["models"] == ["mock-small"]  # the same key, the same policy


async def overlap_is_kept(
    old_client: AsyncOpenAI, new_client: AsyncOpenAI, overlap_end: float
) -> None:
    async with asyncio.timeout(GIVE_UP_S):
        while True:
            await ask(old_client)  # within the overlap: must not fail
            try:
                await ask(new_client)
                break
            except openai.AuthenticationError:
                await asyncio.sleep(0.05)  # the edge has not heard of the rotation yet
    assert time.time() < overlap_end, "the machine was too slow to test the overlap"
    await ask(old_client)
    await ask(new_client)

    # After the overlap only the new secret works.
    async with asyncio.timeout(GIVE_UP_S):
        while time.time() < overlap_end:  # noqa: ASYNC110 - waiting for a moment, not an event
            await asyncio.sleep(overlap_end - time.time())
    with pytest.raises(openai.AuthenticationError, match="expired"):
        await ask(old_client)
    await ask(new_client)


async def listed_by_name(stack: Any, name: str) -> dict[str, Any]:
    keys = json.loads(await stack.control_plane_cli("key", "list", "--json"))
    [entry] = [k for k in keys if k["name"] == name]
    return dict(entry)
