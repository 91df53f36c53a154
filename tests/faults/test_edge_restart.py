"""The edge restarted mid-batch: nodes and the worker dial back within 5 s, and the batch
ends with every line exactly once.

The edge keeps no peer state across a restart (nodes and workers dial it), so the
only things that carry over are its files: the batch database, the run log and
the cached fleet config. The worker's lease outlives the old edge in the batch
database; after a crash it must expire (``batch_lease_ttl_s`` = 3 s in this stack)
before the worker may lease the batch again and resume at its first unfinished line.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
PEERS = {
    "node-a": "node node-a registered",
    "node-b": "node node-b registered",
    "worker": "worker worker registered",
}
RECONNECT_BOUND_S = 5.0  # the bound; the stack's peers back off at most 0.5 s
LINES = 40
LINE_DELAY_MS = 200  # 40 lines x 200 ms over 4 slots: about 2 s of work, long enough to cut


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        yield client


async def submit(sdk: AsyncOpenAI, prefix: str) -> str:
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "mock-small",
                "messages": [{"role": "user", "content": f"{prefix} {i}"}],
                "max_tokens": 1,
                "iop_mock": {"delay_ms": LINE_DELAY_MS},
            },
        }
        for i in range(LINES)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = await sdk.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


async def completed_at_least(sdk: AsyncOpenAI, batch_id: str, count: int) -> int:
    async with asyncio.timeout(30):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            done = batch.request_counts.completed if batch.request_counts else 0
            if done >= count:
                return done
            await asyncio.sleep(0.05)


async def finished(sdk: AsyncOpenAI, batch_id: str) -> Any:
    async with asyncio.timeout(45):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
            await asyncio.sleep(0.2)


async def restart_edge(stack: Stack, signal_number: int) -> tuple[float, float, dict[str, float]]:
    """Stop and start the edge; returns how long the stop took, when the new edge was ready
    (loop time) and, per peer, the seconds from that ``ready:`` line to its registration."""
    loop = asyncio.get_running_loop()
    stopping = loop.time()
    await stack.stop("edge", signal_number)
    stop_s = loop.time() - stopping
    edge = await stack.start("edge")  # returns at the ready line
    ready = loop.time()
    stack.edge_admin = edge.admin_url

    async def registered(line: str) -> float:
        await asyncio.wait_for(edge.wait_for_line(line), 20)
        return loop.time() - ready

    times = await asyncio.gather(*(registered(line) for line in PEERS.values()))
    return stop_s, ready, dict(zip(PEERS, times, strict=True))


async def check_batch(sdk: AsyncOpenAI, batch_id: str, prefix: str) -> Any:
    batch = await finished(sdk, batch_id)
    assert batch.status == "completed", (batch.status, batch.errors)
    assert batch.request_counts is not None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
    assert batch.output_file_id
    output = (await sdk.files.content(batch.output_file_id)).text.splitlines()
    ids = [json.loads(line)["custom_id"] for line in output if line]
    assert sorted(ids) == sorted(f"{prefix}-{i}" for i in range(LINES))  # each exactly once
    assert batch.error_file_id is None
    return batch


@pytest.mark.parametrize(
    "signal_number", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"]
)
async def test_edge_restarted_mid_batch(
    stack: Stack, sdk: AsyncOpenAI, report: Callable[[str], None], signal_number: int
) -> None:
    name = signal.Signals(signal_number).name
    prefix = f"edge-{name.lower()}"
    batch_id = await submit(sdk, prefix)
    done_before = await completed_at_least(sdk, batch_id, 5)

    loop = asyncio.get_running_loop()
    cut = loop.time()
    stop_s, ready, times = await restart_edge(stack, signal_number)
    report(
        f"{name}: edge stopped in {stop_s:.2f}s with {done_before}+ of {LINES} lines done, "
        f"ready again {ready - cut:.2f}s after the cut; "
        + ", ".join(f"{peer} registered {t:.2f}s" for peer, t in times.items())
        + " after the new edge was ready"
    )
    for peer, seconds in times.items():
        assert seconds < RECONNECT_BOUND_S, f"{peer} took {seconds:.2f}s to register again"

    # The worker abandons its lease with the old connection; the new edge hands the batch
    # out again only once that lease has expired (its ttl after the last renewal).
    await asyncio.wait_for(
        stack.services["edge"].wait_for_line(f"batch {batch_id}: leased to worker"), 30
    )
    leased_s = loop.time() - ready
    expired = any("expired" in line and batch_id in line for line in stack.services["edge"].log)
    batch = await check_batch(sdk, batch_id, prefix)
    report(
        f"{name}: batch leased again {leased_s:.2f}s after the new edge was ready "
        f"(the old lease expired first: {'yes' if expired else 'no'}; ttl 3s), "
        f"completed {loop.time() - cut:.1f}s after the cut, "
        f"{batch.request_counts.completed}/{LINES} lines, each custom_id exactly once"
    )
