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
import contextlib
import json
import signal
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
PEERS = ("node-a", "node-b", "worker")
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
    (loop time) and, per peer, the seconds from that ``ready:`` line to its registration
    (seen in the edge's catalog and the peer's ``/readyz``: ``Stack.wait_registered``)."""
    loop = asyncio.get_running_loop()
    stopping = loop.time()
    await stack.stop("edge", signal_number)
    stop_s = loop.time() - stopping
    edge = await stack.start("edge")  # returns at the ready line, on the ports of the first
    ready = loop.time()
    stack.edge_admin = edge.admin_url

    async def registered(peer: str) -> float:
        await stack.wait_registered((peer,))
        return loop.time() - ready

    times = await asyncio.gather(*(registered(peer) for peer in PEERS))
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


def _lost_runs(stack: Stack, node: str, since_ms: int) -> list[tuple[str, str, str, str]]:
    """(run id, outcome, error code, message) of the node's runs received since ``since_ms``."""
    with sqlite3.connect(stack.root / f"{node}-history.db") as db:
        rows = db.execute(
            "SELECT run_id, outcome, error_code, error_message FROM runs WHERE received_ms >= ?",
            (since_ms,),
        ).fetchall()
    return [tuple(row) for row in rows]


async def test_an_edge_crash_ends_every_nodes_runs_alike(
    stack: Stack, report: Callable[[str], None]
) -> None:
    """Both nodes hold a run streaming tokens (sending when the link drops) and a run still
    waiting for its provider (cancelled by the link): the one crash is one outcome on both."""
    since_ms = int(time.time() * 1000)
    loop = asyncio.get_running_loop()
    # 200 tokens/s: sending every 5 ms for 15 s (fill: max_tokens tokens, not a short answer)
    streaming = {"max_tokens": 3000, "iop_mock": {"fill": True}}
    waiting = {"max_tokens": 1, "iop_mock": {"delay_ms": 15_000}}

    async def in_flight(expected: dict[str, int]) -> None:
        async with asyncio.timeout(10):
            while True:
                rows = {r["provider_id"]: r["in_flight"] for r in await _providers(stack)}
                if all(rows[p] == n for p, n in expected.items()):
                    return
                await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as http:

        async def client(extra: dict[str, object]) -> None:
            body = {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}]}
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.post(
                    f"{stack.api_url}/chat/completions", json={**body, **extra, "stream": True}
                ) as response:
                    async for _ in response.content:
                        pass

        # Ties go to node-a, so the requests alternate a, b, a, b: each node gets both kinds.
        clients = []
        for number, extra in enumerate((streaming, streaming, waiting, waiting)):
            clients.append(loop.create_task(client(extra)))
            on_a, on_b = (number + 2) // 2, (number + 1) // 2
            await in_flight({"node-a-mock": on_a, "node-b-mock": on_b})
        await asyncio.sleep(0.3)  # the streams are streaming
        await restart_edge(stack, signal.SIGKILL)
        await asyncio.gather(*clients)

    async with asyncio.timeout(15):  # the nodes' histories are written off the request path
        while True:
            runs = {node: _lost_runs(stack, node, since_ms) for node in ("node-a", "node-b")}
            done = [row for rows in runs.values() for row in rows if row[1] != "running"]
            if len(done) == 4:
                break
            await asyncio.sleep(0.1)
    outcomes = {node: sorted({row[1:] for row in rows}) for node, rows in runs.items()}
    report(f"after the edge's SIGKILL: {outcomes}")
    assert {len(rows) for rows in runs.values()} == {2}
    assert {row[1:] for row in done} == {("cancelled", "cancelled", "the edge connection is gone")}


async def _providers(stack: Stack) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
        async with http.get(url) as response:
            return list((await response.json())["data"])
