"""A second worker process with the same certificate and id, started while the first one
holds a lease (issue 29, item 8): a deployment that runs the worker twice, or a worker
dialling again before its old link is known dead.

The first connection keeps its lease (it is never freed under it, nor lost at its next
renewal), its batch runs to the end under that one lease, and the second connection
takes only batches nobody holds. Before, the second registration freed every lease of
the worker id: the first one lost its batch at the next renewal, and whoever held the
batch then had to start it over.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from openai import AsyncOpenAI

from iop_proto.testing import RunningService, running_service

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
FIRST_LINES = 32  # 32 lines x 500 ms over the worker's 4 slots: 4 s under one lease
SECOND_LINES = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        yield client


async def submit(sdk: AsyncOpenAI, prefix: str, lines: int, delay_ms: int) -> str:
    rows = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "mock-small",
                "messages": [{"role": "user", "content": f"line {i}"}],
                "max_tokens": 1,
                "iop_mock": {"delay_ms": delay_ms},
            },
        }
        for i in range(lines)
    ]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    upload = await sdk.files.create(file=(f"{prefix}.jsonl", data), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


async def completed_once(sdk: AsyncOpenAI, batch_id: str, prefix: str, lines: int) -> None:
    async with asyncio.timeout(60):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.2)  # the edge's state, polled over its API
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (lines, 0)
    assert batch.output_file_id
    output = (await sdk.files.content(batch.output_file_id)).text.splitlines()
    ids = sorted(json.loads(line)["custom_id"] for line in output if line)
    assert ids == sorted(f"{prefix}-{i}" for i in range(lines))  # each exactly once


async def registered(worker: RunningService) -> None:
    """Until the worker says it is registered (its ``/readyz``)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(20):
        while True:
            async with http.get(f"{worker.admin_url}/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.05)  # another process's state


async def test_a_twin_worker_leaves_the_first_ones_lease_alone(
    stack: Stack, sdk: AsyncOpenAI, report: Callable[[str], None]
) -> None:
    edge, worker = stack.services["edge"], stack.services["worker"]
    first = await submit(sdk, "first", FIRST_LINES, 500)
    await asyncio.wait_for(edge.wait_for_line(f"batch {first}: leased to worker"), 15)

    # The twin: the worker's own settings file (same service id, same certificate).
    twin_settings = stack.root / "worker-twin.yaml"
    twin_settings.write_text(
        yaml.safe_dump(yaml.safe_load((stack.root / "worker.yaml").read_text()))
    )
    loop = asyncio.get_running_loop()
    async with running_service("iop-worker", twin_settings) as twin:
        started = loop.time()
        await registered(twin)
        second = await submit(sdk, "second", SECOND_LINES, 50)  # for whoever is free: the twin
        await completed_once(sdk, first, "first", FIRST_LINES)
        first_done = loop.time() - started
        await completed_once(sdk, second, "second", SECOND_LINES)
        twin.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(twin.process.wait(), 30) == 0
    leases = [line for line in edge.log if f"batch {first}: leased to" in line]
    lost = [line for line in worker.log + twin.log if "lost" in line and first in line]
    report(
        f"first batch leased {len(leases)} time(s), lease lost {len(lost)} time(s), "
        f"completed {first_done:.2f}s after the twin started; the twin ran "
        f"{'the second batch' if any(second in line for line in twin.log) else 'nothing'}"
    )
    assert not lost, f"the first worker lost its lease to the twin: {lost}"
    assert len(leases) == 1, leases  # never freed and leased again
    assert not any(first in line for line in twin.log)
    line = await asyncio.wait_for(edge.wait_for_line("a second connection registered"), 5)
    assert "WARNING" in line, line
    assert "worker worker" in line, line
