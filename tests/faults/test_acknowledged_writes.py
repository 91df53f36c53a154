"""Nothing the edge acknowledged as stored is lost when it is SIGKILLed the moment after.

Against the real stack: each kind of write the API answers as stored (a stored
response, non-streamed and streamed, and its deletion; a file upload; a batch
created; a batch cancelled) is made, and the edge is SIGKILLed as soon as the
answer has arrived (no pause: the kill follows the last byte read). After the
edge is started again on the same files, every acknowledged object is there as
acknowledged. The edge's run log may lose its last records to a kill (it is
written behind, and says so); nothing here reads it.

On the code before this, the stored response sat in the response store's
write-behind batch (up to 250 ms) when the client was told it was stored, and
the kill lost it.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
MODEL = "mock-small"
ROUNDS = 3  # kills per kind of stored response
PER_ROUND = 4  # acknowledged writes before each kill, the last one just before it
TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        yield session


async def kill_and_restart(stack: Stack) -> None:
    """SIGKILL the edge (at once: the caller has just read an answer), start it again on
    the same files and ports, and wait until the nodes and the worker are back."""
    await stack.stop("edge", signal.SIGKILL)
    edge = await stack.start("edge")
    stack.edge_admin = edge.admin_url
    await stack.wait_registered(("node-a", "node-b", "worker"))


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as reply:
        payload = await reply.json()
        assert reply.status == 200, payload
        return payload


async def create_response(http: aiohttp.ClientSession, stack: Stack, text: str) -> str:
    body = {"model": MODEL, "input": text, "max_output_tokens": 4}
    answer = await post_json(http, f"{stack.api_url}/responses", body)
    return str(answer["id"])


async def stream_response(http: aiohttp.ClientSession, stack: Stack, text: str) -> str:
    """A streamed response, read up to its last event (``response.completed``, or
    ``response.incomplete`` at the token cap: the answer that says it is stored);
    returns its id."""
    body = {"model": MODEL, "input": text, "max_output_tokens": 4, "stream": True}
    async with http.post(f"{stack.api_url}/responses", json=body) as reply:
        assert reply.status == 200
        async for raw in reply.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if event.get("type") in ("response.completed", "response.incomplete"):
                    return str(event["response"]["id"])
    raise AssertionError("the stream ended without its last event")


async def status_of(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as reply:
        return reply.status, await reply.json()


async def lost_responses(
    http: aiohttp.ClientSession,
    stack: Stack,
    create: Callable[[aiohttp.ClientSession, Stack, str], Any],
    kind: str,
) -> tuple[int, int]:
    """(lost, acknowledged) over ``ROUNDS`` kills, each right after ``PER_ROUND`` writes."""
    lost = acknowledged = 0
    for round_number in range(ROUNDS):
        ids = [await create(http, stack, f"{kind} {round_number}.{n}") for n in range(PER_ROUND)]
        await kill_and_restart(stack)
        acknowledged += len(ids)
        for response_id in ids:
            status, _ = await status_of(http, f"{stack.api_url}/responses/{response_id}")
            lost += status == 404
    return lost, acknowledged


async def test_stored_responses_survive_a_kill_right_after_their_answer(
    stack: Stack, http: aiohttp.ClientSession, report: Callable[[str], None]
) -> None:
    plain = await lost_responses(http, stack, create_response, "plain")
    streamed = await lost_responses(http, stack, stream_response, "streamed")
    report(
        f"stored responses lost to a SIGKILL right after their answer: {plain[0]} of"
        f" {plain[1]} (JSON), {streamed[0]} of {streamed[1]} (streamed)"
    )
    assert (plain[0], streamed[0]) == (0, 0)


async def test_a_deletion_survives_a_kill_right_after_its_answer(
    stack: Stack, http: aiohttp.ClientSession, report: Callable[[str], None]
) -> None:
    response_id = await create_response(http, stack, "to delete")
    await kill_and_restart(stack)  # stored for good before it is deleted
    async with http.delete(f"{stack.api_url}/responses/{response_id}") as reply:
        assert (await reply.json())["deleted"] is True
    await kill_and_restart(stack)
    status, _ = await status_of(http, f"{stack.api_url}/responses/{response_id}")
    report(f"a response deleted right before a SIGKILL: {status} after the restart")
    assert status == 404


async def upload(http: aiohttp.ClientSession, stack: Stack, content: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="batch.jsonl")
    async with http.post(f"{stack.api_url}/files", data=form) as reply:
        payload = await reply.json()
        assert reply.status == 200, payload
        return str(payload["id"])


def batch_lines(prefix: str, count: int, delay_ms: int) -> bytes:
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{prefix} {i}"}],
                "max_tokens": 1,
                "iop_mock": {"delay_ms": delay_ms},
            },
        }
        for i in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def test_files_and_batches_survive_a_kill_right_after_their_answer(
    stack: Stack, http: aiohttp.ClientSession, report: Callable[[str], None]
) -> None:
    content = batch_lines("kept", 2, 0)
    file_id = await upload(http, stack, content)
    await kill_and_restart(stack)
    status, _ = await status_of(http, f"{stack.api_url}/files/{file_id}")
    async with http.get(f"{stack.api_url}/files/{file_id}/content") as reply:
        stored = await reply.read()
    file_kept = status == 200 and stored == content

    # Long lines, so the batch is still running when it is cancelled.
    input_id = await upload(http, stack, batch_lines("slow", 40, 1000))
    body = {"input_file_id": input_id, "endpoint": "/v1/chat/completions"}
    batch = await post_json(http, f"{stack.api_url}/batches", {**body, "completion_window": "24h"})
    await kill_and_restart(stack)
    status, created = await status_of(http, f"{stack.api_url}/batches/{batch['id']}")
    batch_kept = status == 200 and created["input_file_id"] == input_id

    cancelled = await post_json(http, f"{stack.api_url}/batches/{batch['id']}/cancel", {})
    assert cancelled["status"] in ("cancelling", "cancelled")
    await kill_and_restart(stack)
    status, after = await status_of(http, f"{stack.api_url}/batches/{batch['id']}")
    cancel_kept = status == 200 and after["status"] in ("cancelling", "cancelled")
    report(
        "kept after a SIGKILL right after the answer: "
        f"file upload {file_kept}, batch created {batch_kept}, batch cancel {cancel_kept}"
        f" ({after.get('status')})"
    )
    assert (file_kept, batch_kept, cancel_kept) == (True, True, True)
