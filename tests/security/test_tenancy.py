"""Tenancy of the Batch API on the real stack: a key sees only the files and batches it made.

Two API keys issued by the control-plane's CLI, the official OpenAI SDK, a real
worker running A's batch to its end. Key B then tries every way in to A's
objects (retrieve, download, delete, cancel, a batch from A's file, A's output
and error files): each must be a 404 indistinguishable from an id that was
never issued, and B's lists must show none of them. A still has everything.
An operator key makes the same calls and is refused none of them.

Revoking a key cancels its batches: the lines it has in flight are stopped (a
provider slot each, freed), what finished is in the output file, and another
key's batch runs on to completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
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


async def issue_key(stack: Stack, name: str, *options: str) -> tuple[str, str]:
    """A key from the CLI: its id and its secret."""
    out = await stack.control_plane_cli("key", "issue", "--name", name, *options)
    key_id = re.search(r"\bkey_[0-9a-f]+\b", out)
    key = re.search(r"sk-iop-\S+", out)
    assert key_id is not None, out
    assert key is not None, out
    return key_id.group(0), key.group(0)


async def accepted(stack: Stack, key: str) -> bool:
    async with AsyncOpenAI(base_url=stack.api_url, api_key=key, max_retries=0) as client:
        try:
            await client.models.list()
        except openai.AuthenticationError:
            return False
        return True


async def until_known(stack: Stack, *secrets: str) -> None:
    """Until the edge accepts these keys (and so no longer serves an open API)."""
    async with asyncio.timeout(5):  # credentials_poll_s is 0.2 in the test stack
        while not (  # noqa: ASYNC110 - the state lives in another process
            all([await accepted(stack, key) for key in secrets])
            and not await accepted(stack, "sk-iop-not-issued")
        ):
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keys(stack: Stack) -> dict[str, str]:
    """Keys A and B and an operator key ("op"), once the edge knows them."""
    issued = {
        name: (await issue_key(stack, f"tenant-{name}", *options))[1]
        for name, options in (("a", ()), ("b", ()), ("op", ("--operator",)))
    }
    await until_known(stack, *issued.values())
    return issued


def sdk(stack: Stack, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=stack.api_url, api_key=key, max_retries=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(stack: Stack, keys: dict[str, str]) -> AsyncIterator[dict[str, AsyncOpenAI]]:
    made = {name: sdk(stack, key) for name, key in keys.items()}
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


@dataclass(frozen=True)
class Objects:
    """Key A's: a batch run to its end (input, output and error files), one still running."""

    content: bytes  # of the input file
    upload: str
    done: Any  # the completed Batch
    running: str
    files: list[str]
    batches: list[str]


async def make_objects(a: AsyncOpenAI) -> Objects:
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
    return Objects(
        content,
        upload.id,
        done,
        running.id,
        [upload.id, slow_upload.id, done.output_file_id, done.error_file_id],
        [done.id, running.id],
    )


Attempt = tuple[str, str, Callable[[str], Awaitable[Any]]]


def attempts_on(client: AsyncOpenAI, objects: Objects) -> list[Attempt]:
    """Every way in to ``objects``: (what, the object's id, the call); deletes last."""

    def create_from(file_id: str) -> Awaitable[Any]:
        return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")

    return [
        *[(name, f, call) for f in objects.files for name, call in file_reads(client).items()],
        *[("batches.retrieve", x, client.batches.retrieve) for x in objects.batches],
        *[("batches.cancel", x, client.batches.cancel) for x in objects.batches],
        ("batches.create from", objects.upload, create_from),
        *[("files.delete", f, client.files.delete) for f in objects.files],
    ]


async def outcomes_of(attempts: list[Attempt]) -> list[tuple[int, dict[str, Any] | None]]:
    return [await outcome(lambda c=call, i=object_id: c(i)) for _, object_id, call in attempts]


async def test_a_key_is_told_another_keys_objects_do_not_exist(
    clients: dict[str, AsyncOpenAI], request: pytest.FixtureRequest
) -> None:
    a, b = clients["a"], clients["b"]
    objects = await make_objects(a)
    files, batches, done = objects.files, objects.batches, objects.done

    # Where B's deletes get through, A's files are gone: they come last.
    attempts = attempts_on(b, objects)
    outcomes = await outcomes_of(attempts)
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
    assert (await a.files.content(objects.upload)).content == objects.content
    output = (await a.files.content(done.output_file_id)).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["a-0", "a-1"]
    assert (await a.files.retrieve(done.error_file_id)).purpose == "batch_output"
    still = await a.batches.retrieve(objects.running)
    assert still.status in ("validating", "in_progress")  # B's cancel did nothing
    assert (await a.batches.cancel(objects.running)).status in ("cancelling", "cancelled")
    with pytest.raises(openai.NotFoundError):
        await a.files.retrieve(b_file.id)
    print(
        f"\n[{request.node.name}] cross-tenant reads and actions refused with 404: "
        f"{len(attempts) - len(served)} of {len(attempts)} "
        f"({len(files)} files x retrieve/content/delete, "
        f"{len(batches)} batches x retrieve/cancel, 1 batch from A's file); "
        f"B's lists showed 0 of A's {len(a_objects)} objects"
    )


async def test_an_operator_key_reads_and_acts_on_another_keys_objects(
    clients: dict[str, AsyncOpenAI], request: pytest.FixtureRequest
) -> None:
    a, op = clients["a"], clients["op"]
    objects = await make_objects(a)
    done = objects.done
    listed_files = {f.id async for f in op.files.list()}
    listed_batches = {x.id async for x in op.batches.list()}
    assert set(objects.files) <= listed_files
    assert set(objects.batches) <= listed_batches
    # What A reads, the operator reads the same.
    assert (await op.files.content(objects.upload)).content == objects.content
    for file_id in (done.output_file_id, done.error_file_id):
        assert (await op.files.content(file_id)).content == (await a.files.content(file_id)).content
    output = (await op.files.content(done.output_file_id)).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["a-0", "a-1"]
    assert (await op.batches.retrieve(done.id)).request_counts == done.request_counts

    # Every call B was refused, the operator gets through (its deletes last).
    attempts = attempts_on(op, objects)
    outcomes = await outcomes_of(attempts)
    refused = {
        f"{what} {object_id}": status
        for (what, object_id, _), (status, _) in zip(attempts, outcomes, strict=True)
        if status != 200
    }
    assert refused == {}, f"the operator key was refused: {refused}"
    cancelled = await wait_for_status(a, objects.running, "cancelled")  # the operator's cancel
    assert cancelled.cancelling_at is not None
    for file_id in objects.files:  # ... and its deletes
        with pytest.raises(openai.NotFoundError):
            await a.files.retrieve(file_id)
    print(
        f"\n[{request.node.name}] an operator key's reads and actions on another key's "
        f"objects served: {len(attempts) - len(refused)} of {len(attempts)}"
    )


# --- revocation ----------------------------------------------------------------------------

# Far longer than the revocation may take: what ends within half of it was ended by the
# revocation, not by the lines finishing (a loaded machine may take seconds, not 10).
SLOW_LINE_MS = 20_000
REVOKED_WITHIN_S = SLOW_LINE_MS / 1000 / 2


async def providers_in_flight(stack: Stack, operator_key: str) -> dict[str, int]:
    url = stack.api_url.removesuffix("/v1") + "/iop/v1/catalog/providers"
    headers = {"Authorization": f"Bearer {operator_key}"}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as response:
        assert response.status == 200
        rows = (await response.json())["data"]
    return {row["provider_id"]: row["in_flight"] for row in rows}


async def custom_ids(client: AsyncOpenAI, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line)["custom_id"] for line in content.text.splitlines() if line]


async def test_revoking_a_key_cancels_its_batches_and_stops_their_lines(
    stack: Stack,
    keys: dict[str, str],
    clients: dict[str, AsyncOpenAI],
    request: pytest.FixtureRequest,
) -> None:
    op, op_key = clients["op"], keys["op"]
    victim_id, victim_key = await issue_key(stack, "batch-victim")
    _, keeper_key = await issue_key(stack, "batch-keeper")
    await until_known(stack, victim_key, keeper_key)
    quick = [chat_line(f"quick-{n}", max_tokens=1) for n in range(4)]
    slow = [
        chat_line(f"slow-{n}", max_tokens=1, iop_mock={"delay_ms": SLOW_LINE_MS}) for n in range(8)
    ]
    async with sdk(stack, victim_key) as victim, sdk(stack, keeper_key) as keeper:

        async def submit(client: AsyncOpenAI, lines: list[dict[str, Any]]) -> str:
            upload = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            made = await client.batches.create(
                input_file_id=upload.id, endpoint=CHAT, completion_window="24h"
            )
            return made.id

        running = await submit(victim, quick + slow)  # the worker's four lines at a time
        waiting = await submit(victim, [chat_line("never-run", max_tokens=1)])
        kept = await submit(
            keeper, [chat_line(f"kept-{n}", "solo", max_tokens=1) for n in range(3)]
        )
        # The quick lines are done, four slow ones hold all four mock-small slots.
        async with asyncio.timeout(30):
            while True:
                batch = await victim.batches.retrieve(running)
                flights = await providers_in_flight(stack, op_key)
                done = batch.request_counts.completed if batch.request_counts else 0
                if done == len(quick) and flights["node-a-mock"] + flights["node-b-mock"] == 4:
                    break
                await asyncio.sleep(0.05)

        await stack.control_plane_cli("key", "revoke", victim_id)
        revoked_at = time.monotonic()
        ended: dict[str, Any] = {}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REVOKED_WITHIN_S):
                while len(ended) < 2:
                    for batch_id in (running, waiting):
                        batch = await op.batches.retrieve(batch_id)
                        if batch.status == "cancelled" and batch_id not in ended:
                            ended[batch_id] = batch
                    await asyncio.sleep(0.05)
        latency = time.monotonic() - revoked_at
        statuses = [(await op.batches.retrieve(x)).status for x in (running, waiting)]
        assert len(ended) == 2, f"{latency:.1f} s after the revoke its batches were {statuses}"
        # ... and its lines in flight were stopped: their slots are free long before they end.
        async with asyncio.timeout(REVOKED_WITHIN_S):
            while True:
                flights = await providers_in_flight(stack, op_key)
                if flights["node-a-mock"] + flights["node-b-mock"] == 0:
                    break
                await asyncio.sleep(0.05)
        freed = time.monotonic() - revoked_at
        assert freed < REVOKED_WITHIN_S

        cut = ended[running]
        assert cut.request_counts is not None
        total = len(quick) + len(slow)
        assert (cut.request_counts.total, cut.request_counts.completed) == (total, len(quick))
        assert cut.cancelling_at is not None
        assert sorted(await custom_ids(op, cut.output_file_id)) == [q["custom_id"] for q in quick]
        errors = (await op.files.content(cut.error_file_id or "")).text.splitlines()
        assert sorted(json.loads(e)["custom_id"] for e in errors) == sorted(
            s["custom_id"] for s in slow
        )
        assert {json.loads(e)["error"]["code"] for e in errors} == {"batch_cancelled"}
        never = ended[waiting]
        assert never.output_file_id is None
        assert await custom_ids(op, never.error_file_id) == ["never-run"]
        with pytest.raises(openai.AuthenticationError):
            await victim.batches.retrieve(running)

        # The other key's batch, waiting behind the victim's, runs to its end.
        finished = await wait_for_status(keeper, kept, "completed")
        assert finished.request_counts is not None
        assert finished.request_counts.completed == 3
    said = f"API key {victim_id} revoked: cancelled its"
    log = [line for line in stack.services["edge"].log if said in line]
    assert len(log) == 1, log  # once per key, with the count
    assert f"{said} 2 batch(es)" in log[0]
    print(
        f"\n[{request.node.name}] revoked key's 2 batches cancelled {latency:.3f}s after the "
        f"revoke command returned; its 4 lines in flight stopped ({freed:.3f}s), "
        f"{len(quick)} of {len(quick) + len(slow)} lines done; the other key's batch completed"
    )
