"""A node SIGKILLed mid-stream under 20 concurrent streams spread over two nodes."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

REQUEST_TIMEOUT_S = 20


MOCK = {
    "capacity": 4,
    "max_queue": 8,
    "queue_timeout_ms": 15_000,
    "request_timeout_ms": REQUEST_TIMEOUT_S * 1000,
    "tokens_per_second": 20,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, faults: Any
) -> AsyncIterator[Any]:
    fleet = faults.pool_fleet("pool", "mock", **MOCK)
    root = Path(tmp_path_factory.mktemp("killed"))
    async with start_stack_factory(root, fleet) as running:
        yield running


async def test_node_killed_mid_stream(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    catalog, eventually, stream_chat = faults.catalog, faults.eventually, faults.stream_chat
    body = {"model": "pool", "messages": [{"role": "user", "content": "go"}], "max_tokens": 30}
    streaming = asyncio.Semaphore(0)  # released by each stream that got its first delta
    async with aiohttp.ClientSession() as http:
        clients = [
            asyncio.create_task(
                stream_chat(
                    http, stack.api_url, body, REQUEST_TIMEOUT_S + 5, on_start=streaming.release
                )
            )
            for _ in range(20)
        ]

        async def both_busy() -> bool:
            rows = await catalog(stack.api_url, "providers")
            return all(r["in_flight"] == 4 for r in rows)

        await eventually(both_busy)
        # The runs in flight have streamed (a run fails over only before its first delta,
        # so one killed earlier would finish on node-b): eight streams, each node's four,
        # started before any queued one can (a slot frees only when a stream ends).
        async with asyncio.timeout(15):
            for _ in range(8):
                await streaming.acquire()

        async def starts_on_disk() -> bool:
            # The node's history writes a run's start within its flush interval, not at
            # once: killed before that, a run leaves nothing for the restart to mark.
            with sqlite3.connect(stack.root / "node-a-history.db") as db:
                running = db.execute("SELECT COUNT(*) FROM runs WHERE outcome = 'running'")
                return bool(running.fetchone()[0] >= 1)

        await eventually(starts_on_disk)
        await stack.stop("node-a", signal.SIGKILL)
        outcomes = await asyncio.gather(*clients)

    counts = Counter(o.kind for o in outcomes)
    codes = Counter(o.detail for o in outcomes if o.kind == "error")
    report(f"outcomes {dict(counts)}, error codes {dict(codes)}")
    assert counts["hung"] == 0
    assert counts["completed"] + counts["error"] == 20
    assert counts["error"] >= 4  # node-a's streams in flight could not finish
    assert counts["completed"] >= 12  # the queued requests went on on node-b

    async def drained() -> bool:
        rows = await catalog(stack.api_url, "providers")
        models = await catalog(stack.api_url, "models")
        return all(r["in_flight"] == 0 for r in rows) and all(m["queued"] == 0 for m in models)

    await eventually(drained)
    providers = {r["provider_id"]: r for r in await catalog(stack.api_url, "providers")}
    assert providers["node-a-mock"]["health"] == "unavailable"

    await stack.start("node-a")
    await stack.wait_registered(("node-a",))
    with sqlite3.connect(stack.root / "node-a-history.db") as db:
        interrupted = db.execute(
            "SELECT COUNT(*) FROM runs WHERE outcome = 'failed' AND error_code = 'interrupted'"
        ).fetchone()[0]
    report(f"node-a history after restart: {interrupted} runs marked interrupted")
    assert interrupted >= 1

    async def node_a_back() -> bool:
        rows = {r["provider_id"]: r for r in await catalog(stack.api_url, "providers")}
        return bool(rows["node-a-mock"]["health"] == "available")

    await eventually(node_a_back)
