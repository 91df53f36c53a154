"""A worker sent SIGTERM while its lines run drains as docs/ARCHITECTURE.md's "Stopping" says.

The lines in flight finish and their results are kept (none is cut, none fails), no
new line is dispatched, the process exits 0, and the batch's lease goes with the
worker's connection: a worker started again resumes it at the first unfinished line,
and every line's result is in the output exactly once.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
LINES = 12
DELAY_MS = 1500  # long enough that SIGTERM finds lines running, far inside the 8 s drain


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        yield client


async def submit(sdk: AsyncOpenAI) -> str:
    rows = [
        {
            "custom_id": f"drain-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "mock-small",
                "messages": [{"role": "user", "content": f"line {i}"}],
                "max_tokens": 1,
                "iop_mock": {"delay_ms": DELAY_MS},
            },
        }
        for i in range(LINES)
    ]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    upload = await sdk.files.create(file=("drain.jsonl", data), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


async def lines_in_flight(admin_url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    found = re.search(r"^iop_worker_lines_in_flight (\S+)$", text, re.MULTILINE)
    assert found is not None, "the worker does not export iop_worker_lines_in_flight"
    return float(found.group(1))


async def test_sigterm_lets_the_lines_in_flight_finish_and_the_batch_resumes(
    stack: Stack, sdk: AsyncOpenAI, faults: Any
) -> None:
    worker = stack.services["worker"]
    batch_id = await submit(sdk)

    async def running() -> bool:
        return await lines_in_flight(worker.admin_url) >= 1

    await faults.eventually(running, timeout_s=20)
    assert await stack.stop("worker") == 0  # SIGTERM

    ended = [line for line in worker.log if f"batch {batch_id} left to its lease expiry" in line]
    assert ended, "the worker did not say what became of its batch"
    counts = re.search(r"\(stopping\): (\d+) done, (\d+) failed of (\d+)", ended[-1])
    assert counts is not None, ended[-1]
    done, failed, remaining = map(int, counts.groups())
    assert done >= 1  # the lines in flight at the signal finished, not cut
    assert failed == 0
    assert done < remaining  # and the rest were not started
    batch = await sdk.batches.retrieve(batch_id)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (done, 0)

    await stack.start("worker")  # the edge freed the lease with the old connection
    async with asyncio.timeout(90):
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.2)  # the edge's state, polled over its API
            batch = await sdk.batches.retrieve(batch_id)
    assert batch.status == "completed", batch
    assert batch.output_file_id
    output = (await sdk.files.content(batch.output_file_id)).text.splitlines()
    ids = sorted(json.loads(line)["custom_id"] for line in output if line)
    assert ids == sorted(f"drain-{i}" for i in range(LINES))  # each exactly once
