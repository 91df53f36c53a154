"""Tenancy of the Batch API on the real stack: a key sees only the files and batches it made.

Two API keys issued by the control-plane's CLI, the official OpenAI SDK, a real
worker running A's batch to its end. Key B then tries every way in to A's
objects (retrieve, download, delete, cancel, a batch from A's file, A's output
and error files): each must be a 404 indistinguishable from an id that was
never issued, and B's lists must show none of them. A still has everything.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
CHAT = "/v1/chat/completions"
NEVER_ISSUED = {"file": "file-" + "0" * 32, "batch": "batch_" + "0" * 32}


def file_reads(client: AsyncOpenAI) -> dict[str, Callable[[str], Awaitable[Any]]]:
    return {"files.retrieve": client.files.retrieve, "files.content": client.files.content}


async def issue_key(stack: Stack, name: str) -> str:
    out = await stack.control_plane_cli("key", "issue", "--name", name)
    key = re.search(r"sk-iop-\S+", out)
    assert key is not None, out
    return key.group(0)


async def accepted(stack: Stack, key: str) -> bool:
    async with AsyncOpenAI(base_url=stack.api_url, api_key=key, max_retries=0) as client:
        try:
            await client.models.list()
        except openai.AuthenticationError:
            return False
        return True


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keys(stack: Stack) -> dict[str, str]:
    """Keys A and B, once the edge knows both (and so no longer serves an open API)."""
    issued = {name: await issue_key(stack, f"tenant-{name}") for name in ("a", "b")}
    async with asyncio.timeout(5):  # credentials_poll_s is 0.2 in the test stack
        while not (  # noqa: ASYNC110 - the state lives in another process
            all([await accepted(stack, key) for key in issued.values()])
            and not await accepted(stack, "sk-iop-not-issued")
        ):
            await asyncio.sleep(0.05)
    return issued


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(stack: Stack, keys: dict[str, str]) -> AsyncIterator[dict[str, AsyncOpenAI]]:
    made = {
        name: AsyncOpenAI(base_url=stack.api_url, api_key=key, max_retries=0)
        for name, key in keys.items()
    }
    try:
        yield made
    finally:
        for client in made.values():
            await client.close()


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, model: str = "mock-small", **body: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": custom_id}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


async def wait_for_status(client: AsyncOpenAI, batch_id: str, *statuses: str) -> Any:
    async with asyncio.timeout(60):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            await asyncio.sleep(0.2)


async def outcome(call: Callable[[], Awaitable[Any]]) -> tuple[int, dict[str, Any] | None]:
    """The HTTP status of an SDK call and its error object (``None`` on success)."""
    try:
        await call()
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body if isinstance(exc.body, dict) else None
    return 200, None


async def test_a_key_is_told_another_keys_objects_do_not_exist(
    clients: dict[str, AsyncOpenAI], request: pytest.FixtureRequest
) -> None:
    a, b = clients["a"], clients["b"]
    lines = [chat_line(f"a-{n}", max_tokens=1) for n in range(2)] + [chat_line("x", "nope")]
    content = jsonl(lines)
    upload = await a.files.create(file=("a.jsonl", content), purpose="batch")
    done = await wait_for_status(
        a,
        (
            await a.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
        ).id,
        "completed",
    )
    assert done.output_file_id is not None
    assert done.error_file_id is not None
    slow = [chat_line(f"slow-{n}", max_tokens=1, iop_mock={"delay_ms": 300}) for n in range(30)]
    slow_upload = await a.files.create(file=("slow.jsonl", jsonl(slow)), purpose="batch")
    running = await a.batches.create(
        input_file_id=slow_upload.id, endpoint=CHAT, completion_window="24h"
    )
    files = [upload.id, slow_upload.id, done.output_file_id, done.error_file_id]
    batches = [done.id, running.id]

    def create_from(file_id: str) -> Awaitable[Any]:
        return b.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")

    # (what, A's object, B's call); deletes last: where they get through, A's files are gone.
    attempts: list[tuple[str, str, Callable[[str], Awaitable[Any]]]] = [
        *[(name, f, call) for f in files for name, call in file_reads(b).items()],
        *[("batches.retrieve", x, b.batches.retrieve) for x in batches],
        *[("batches.cancel", x, b.batches.cancel) for x in batches],
        ("batches.create from", upload.id, create_from),
        *[("files.delete", f, b.files.delete) for f in files],
    ]
    outcomes = [await outcome(lambda c=call, i=object_id: c(i)) for _, object_id, call in attempts]
    served = {
        f"{what} {object_id}": status
        for (what, object_id, _), (status, _) in zip(attempts, outcomes, strict=True)
        if status != 404
    }
    assert served == {}, f"key B reached key A's objects: {served}"
    for (what, object_id, call), (_, body) in zip(attempts, outcomes, strict=True):
        # The very answer an id never issued gets: nothing tells B the object exists.
        unknown = NEVER_ISSUED["batch" if object_id.startswith("batch_") else "file"]
        expected = json.loads(json.dumps(body).replace(object_id, unknown))
        assert await outcome(lambda c=call, u=unknown: c(u)) == (404, expected), what

    a_objects = set(files) | set(batches)
    b_file = await b.files.create(file=("b.jsonl", jsonl([chat_line("b-0")])), purpose="batch")
    b_files = {f.id async for f in b.files.list()}
    b_batches = {x.id async for x in b.batches.list()}
    assert b_files == {b_file.id}
    assert b_batches == set()

    # A still sees, reads and acts on all of its own, and nothing of B's.
    assert {f.id async for f in a.files.list()} == set(files)
    assert {x.id async for x in a.batches.list()} == set(batches)
    assert (await a.files.content(upload.id)).content == content
    output = (await a.files.content(done.output_file_id)).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["a-0", "a-1"]
    assert (await a.files.retrieve(done.error_file_id)).purpose == "batch_output"
    still = await a.batches.retrieve(running.id)
    assert still.status in ("validating", "in_progress")  # B's cancel did nothing
    assert (await a.batches.cancel(running.id)).status in ("cancelling", "cancelled")
    with pytest.raises(openai.NotFoundError):
        await a.files.retrieve(b_file.id)
    print(
        f"\n[{request.node.name}] cross-tenant reads and actions refused with 404: "
        f"{len(attempts) - len(served)} of {len(attempts)} "
        f"({len(files)} files x retrieve/content/delete, "
        f"{len(batches)} batches x retrieve/cancel, 1 batch from A's file); "
        f"B's lists showed 0 of A's {len(a_objects)} objects"
    )
