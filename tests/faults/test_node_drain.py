"""A node stopped with SIGTERM mid-stream: its runs finish, new requests go elsewhere."""

from __future__ import annotations

import asyncio
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
    "capacity": 2,
    "max_queue": 8,
    "queue_timeout_ms": 15_000,
    "request_timeout_ms": REQUEST_TIMEOUT_S * 1000,
    "tokens_per_second": 20,  # 40 tokens: two seconds per stream
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, faults: Any
) -> AsyncIterator[Any]:
    fleet = faults.pool_fleet("pool", "mock", **MOCK)
    root = Path(tmp_path_factory.mktemp("drain"))
    async with start_stack_factory(root, fleet) as running:
        yield running


async def test_sigterm_lets_the_runs_in_flight_finish(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    catalog, eventually, stream_chat = faults.catalog, faults.eventually, faults.stream_chat
    body = {
        "model": "pool",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 40,
        "iop_mock": {"fill": True},  # 40 tokens, not the mock's short answer
    }

    streaming = 0

    def started() -> None:
        nonlocal streaming
        streaming += 1

    async with aiohttp.ClientSession() as http:

        def client(on_start: Callable[[], None] | None = None) -> asyncio.Task[Any]:
            return asyncio.create_task(
                stream_chat(http, stack.api_url, body, REQUEST_TIMEOUT_S + 5, on_start)
            )

        first = [client(started) for _ in range(4)]

        async def both_busy() -> bool:
            # The edge counts a run from its dispatch, so its two per provider may still be
            # unread on a busy node, which then stops with nothing in flight and the edge
            # sends them elsewhere (as it should). Only a run that streams is in flight on
            # its node: all four streaming, two on each, is what this test is about.
            rows = await catalog(stack.api_url, "providers")
            return streaming == 4 and all(r["in_flight"] == 2 for r in rows)

        await eventually(both_busy)
        stopping = asyncio.create_task(stack.stop("node-a"))  # SIGTERM

        async def node_a_out_of_rotation() -> bool:
            rows = {r["provider_id"]: r for r in await catalog(stack.api_url, "providers")}
            return bool(rows["node-a-mock"]["health"] == "unavailable")

        await eventually(node_a_out_of_rotation, timeout_s=5)
        assert not stopping.done()  # still draining: its two streams are not over yet
        later = [client() for _ in range(2)]  # they wait for node-b, never reach node-a
        outcomes = await asyncio.gather(*first, *later)
        exit_code = await stopping

    counts = Counter(o.kind for o in outcomes)
    report(f"outcomes {dict(counts)}, node-a exit code {exit_code}")
    assert counts == {"completed": 6}
    assert exit_code == 0
    with sqlite3.connect(stack.root / "node-a-history.db") as db:
        rows = db.execute("SELECT outcome, COUNT(*) FROM runs GROUP BY outcome").fetchall()
    assert dict(rows) == {"completed": 2}  # nothing cancelled, nothing interrupted
