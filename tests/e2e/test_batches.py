"""The OpenAI Batch API end to end: the official SDK, the edge, a real worker, real nodes."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        yield client


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, model: str = "mock-small", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": custom_id}], **body},
    }


async def submit(sdk: AsyncOpenAI, lines: list[dict[str, Any]]) -> str:
    upload = await sdk.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


async def wait_for_status(sdk: AsyncOpenAI, batch_id: str, *statuses: str) -> Any:
    async with asyncio.timeout(90):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            await asyncio.sleep(0.2)


async def output_ids(sdk: AsyncOpenAI, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    content = await sdk.files.content(file_id)
    return [json.loads(line)["custom_id"] for line in content.text.splitlines() if line]


async def test_upload_run_and_download_with_the_sdk(sdk: AsyncOpenAI) -> None:
    lines = [chat_line(f"req-{i}", max_tokens=3) for i in range(5)]
    lines.append(chat_line("unknown-model", model="no-such-model"))
    batch_id = await submit(sdk, lines)
    batch = await wait_for_status(sdk, batch_id, "completed")
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (6, 5)
    assert batch.request_counts.failed == 1
    assert sorted(await output_ids(sdk, batch.output_file_id)) == [f"req-{i}" for i in range(5)]
    assert await output_ids(sdk, batch.error_file_id) == ["unknown-model"]
    first = (await sdk.files.content(batch.output_file_id or "")).text.splitlines()[0]
    response = json.loads(first)["response"]
    assert response["status_code"] == 200
    assert response["body"]["model"] == "mock-small"  # the public id, never the served name


async def test_cancel_a_running_batch_keeps_finished_lines(sdk: AsyncOpenAI) -> None:
    lines = [chat_line(f"slow-{i}", max_tokens=1, iop_mock={"delay_ms": 300}) for i in range(40)]
    batch_id = await submit(sdk, lines)
    async with asyncio.timeout(60):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.request_counts and batch.request_counts.completed >= 4:
                break
            await asyncio.sleep(0.1)
    cancelling = await sdk.batches.cancel(batch_id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await wait_for_status(sdk, batch_id, "cancelled")
    kept = await output_ids(sdk, done.output_file_id)
    assert 4 <= len(kept) < 40
    assert len(set(kept)) == len(kept)


async def test_a_killed_worker_is_replaced_and_every_line_runs_exactly_once(
    stack: Stack, sdk: AsyncOpenAI
) -> None:
    lines = [chat_line(f"job-{i}", max_tokens=1, iop_mock={"delay_ms": 150}) for i in range(40)]
    batch_id = await submit(sdk, lines)
    async with asyncio.timeout(60):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.request_counts and batch.request_counts.completed >= 5:
                break
            await asyncio.sleep(0.1)
    await stack.stop("worker", signal.SIGKILL)
    await stack.start("worker")
    done = await wait_for_status(sdk, batch_id, "completed")
    ids = await output_ids(sdk, done.output_file_id)
    assert sorted(ids) == sorted(f"job-{i}" for i in range(40))  # each exactly once
    assert done.request_counts is not None
    assert done.request_counts.completed == 40


async def test_interactive_requests_overtake_waiting_batch_lines(sdk: AsyncOpenAI) -> None:
    """`solo` has one slot: the worker's lines queue for it; a chat request goes first."""
    lines = [
        chat_line(f"bulk-{i}", model="solo", max_tokens=1, iop_mock={"delay_ms": 400})
        for i in range(12)
    ]
    batch_id = await submit(sdk, lines)
    async with asyncio.timeout(60):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            counts = batch.request_counts
            if batch.status == "in_progress" and counts and counts.completed >= 1:
                break
            await asyncio.sleep(0.05)
    before = (await sdk.batches.retrieve(batch_id)).request_counts
    answer = await sdk.chat.completions.create(
        model="solo", messages=[{"role": "user", "content": "me first"}], max_tokens=1
    )
    after = (await sdk.batches.retrieve(batch_id)).request_counts
    assert answer.usage is not None
    assert before is not None
    assert after is not None
    # at most the line holding the slot finished first; the queued lines waited
    assert after.completed - before.completed <= 1, (before, after)
    await wait_for_status(sdk, batch_id, "completed")
