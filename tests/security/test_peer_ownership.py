"""A registered peer speaks only of what is its own (issue 14, item 1).

An attacker holding a valid node certificate and token (``node-fuzz``, in the fleet
with no providers) or a valid worker certificate (``worker-evil``) forges frames
about another peer's run, provider or lease. Run ids are not secrets: the client
reads them in ``X-Request-Id``. Each forgery closes the attacker's connection with
a ``PERMISSION_DENIED`` error frame, is logged with its certificate identity and
counted; the victim's run, provider and batch go on untouched.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed
from iop_proto.testing import open_client
from iop_proto.tls import client_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
TOKENS = 300  # node-a-solo streams 200 tokens/s: 1.5 s to forge into
FORGED_USAGE = pb.Usage(prompt_tokens=1, completion_tokens=99_999, total_tokens=100_000)
BATCH_LINES = 24  # 24 lines x 500 ms over the worker's 4 slots: 3 s of lease to forge on
REFUSALS = re.compile(
    r'iop_edge_peer_refusals_total\{reason="(\w+)",role="(\w+)",stage="ownership"\} (\S+)'
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        yield client


async def refusals(stack: Stack) -> dict[tuple[str, str], int]:
    """The edge's ownership refusals by (role, reason)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.edge_admin}/metrics") as response:
            text = await response.text()
    return {(role, reason): int(float(n)) for reason, role, n in REFUSALS.findall(text)}


async def attacker(stack: Stack, name: str, role: int) -> Connection:
    """A registered connection with a valid certificate (and token, for a node)."""
    token = ""
    if role == pb.PEER_ROLE_NODE:
        out = await stack.control_plane_cli("token", "issue", "--node", name)
        match = re.search(r"iopnt_\S+", out)
        assert match is not None
        token = match.group(0)
    reader, writer = await open_client(stack.node_port, client_context(stack.tls(name)))
    conn = Connection(reader, writer, sender_id=name, heartbeat_interval=0)
    await conn.send(pb.RegisterRequest(peer_id=name, token=token, role=role))
    answer = await asyncio.wait_for(conn.receive(), 10)
    assert answer.register_response.accepted, answer
    return conn


async def assert_thrown_out(conn: Connection) -> pb.Error:
    """The edge answers the forgery with an error frame and closes the connection."""
    try:
        async with asyncio.timeout(5):
            while True:
                envelope = await conn.receive()
                if envelope.WhichOneof("body") == "error":
                    break
            error = envelope.error
            with pytest.raises(ConnectionClosed):  # and nothing after it: closed
                await conn.receive()
    except TimeoutError:
        raise AssertionError("the edge kept the forging connection open") from None
    finally:
        await conn.close()
    assert error.code == pb.ERROR_CODE_PERMISSION_DENIED, error
    return error


async def provider_view(stack: Stack, provider_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
        async with http.get(url) as response:
            rows = (await response.json())["data"]
    [row] = [row for row in rows if row["provider_id"] == provider_id]
    return dict(row)


async def run_record(stack: Stack, run_id: str) -> dict[str, Any]:
    """The edge's run log entry (written off the request path: wait for it)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(10):
        while True:
            url = stack.api_url.replace("/v1", "/iop/v1/runs?limit=200")
            async with http.get(url) as response:
                rows = (await response.json())["data"]
            found = [row for row in rows if row["run_id"] == run_id]
            if found:
                return dict(found[0])
            await asyncio.sleep(0.1)


def forged_event(kind: str, run_id: str) -> pb.RunEvent:
    if kind == "delta":
        return pb.RunEvent(run_id=run_id, sequence=5, delta=pb.RunDelta(text="FORGED TEXT "))
    if kind == "complete":
        complete = pb.RunComplete(finish_reason="stop", usage=FORGED_USAGE)
        return pb.RunEvent(run_id=run_id, sequence=5, complete=complete)
    error = pb.RunError(code=pb.ERROR_CODE_PROVIDER_UNAVAILABLE, message="FORGED: provider down")
    return pb.RunEvent(run_id=run_id, sequence=5, error=error)


@pytest.mark.parametrize("kind", ["delta", "complete", "error"])
async def test_a_node_cannot_write_into_another_nodes_run(
    stack: Stack, sdk: AsyncOpenAI, kind: str
) -> None:
    before = await refusals(stack)
    conn = await attacker(stack, "node-fuzz", pb.PEER_ROLE_NODE)
    # "solo" is served by node-a-solo only: the run is node-a's.
    async with sdk.chat.completions.with_streaming_response.create(
        model="solo",
        messages=[{"role": "user", "content": "whose run is this"}],
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"iop_mock": {"fill": True}},  # TOKENS tokens, not a short answer
    ) as response:
        run_id = response.headers["x-request-id"]
        await conn.send(forged_event(kind, run_id), correlation_id=run_id)
        text, finish, usage = [], None, None
        async for chunk in await response.parse():  # a forged error would raise here
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage

    assert "FORGED" not in "".join(text)
    assert finish == "length"  # node-a's own end, not the forger's
    assert usage is not None
    assert usage.completion_tokens == TOKENS
    error = await assert_thrown_out(conn)
    assert run_id in error.message

    record = await run_record(stack, run_id)
    assert (record["node_id"], record["provider_id"], record["outcome"]) == (
        "node-a",
        "node-a-solo",
        "completed",
    )
    assert record["completion_tokens"] == TOKENS  # node-a's real usage
    assert (await provider_view(stack, "node-a-solo"))["health"] == "available"

    line = await asyncio.wait_for(
        stack.services["edge"].wait_for_line(f"for run {run_id}, which was dispatched"), 5
    )
    assert "refused node node-fuzz (certificate role node)" in line
    after = await refusals(stack)
    assert after[("node", "foreign_run")] == before.get(("node", "foreign_run"), 0) + 1


@pytest.mark.parametrize("claim", ["another node's provider", "in another node's name"])
async def test_a_node_cannot_report_another_nodes_provider(stack: Stack, claim: str) -> None:
    before = await refusals(stack)
    conn = await attacker(stack, "node-fuzz", pb.PEER_ROLE_NODE)
    down = pb.ProviderState(
        provider_id="node-a-mock", health=pb.HEALTH_UNAVAILABLE, capacity=2, in_flight=2
    )
    if claim == "another node's provider":
        snapshot = pb.ProviderSnapshot(node_id="node-fuzz", providers=[down])
        reason = "foreign_provider"
    else:
        snapshot, reason = pb.ProviderSnapshot(node_id="node-a"), "foreign_node"
    # Providers outside the fleet are ignored, as always, and the connection lives on.
    ghost = pb.ProviderState(provider_id="ghost-provider", health=pb.HEALTH_AVAILABLE)
    await conn.send(pb.ProviderSnapshot(node_id="node-fuzz", providers=[ghost]))
    await conn.send(snapshot)
    await assert_thrown_out(conn)

    view = await provider_view(stack, "node-a-mock")
    assert (view["node_id"], view["health"], view["in_flight"]) == ("node-a", "available", 0)
    log = "".join(stack.services["edge"].log)
    assert f"refused node node-fuzz (certificate role node) at ownership ({reason})" in log
    after = await refusals(stack)
    assert after[("node", reason)] == before.get(("node", reason), 0) + 1


async def submit_batch(sdk: AsyncOpenAI) -> str:
    lines = [
        {
            "custom_id": f"victim-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "mock-small",
                "messages": [{"role": "user", "content": f"line {i}"}],
                "max_tokens": 1,
                "iop_mock": {"delay_ms": 500},
            },
        }
        for i in range(BATCH_LINES)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = await sdk.files.create(file=("victim.jsonl", data), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


async def finished(sdk: AsyncOpenAI, batch_id: str) -> Any:
    async with asyncio.timeout(30):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
            await asyncio.sleep(0.2)


async def test_a_worker_acts_only_on_leases_it_holds(stack: Stack, sdk: AsyncOpenAI) -> None:
    before = await refusals(stack)
    batch_id = await submit_batch(sdk)
    edge = stack.services["edge"]
    await asyncio.wait_for(edge.wait_for_line(f"batch {batch_id}: leased to worker"), 15)
    # The attacker is assumed to know the lease id (the edge logs it at DEBUG only).
    with sqlite3.connect(f"file:{stack.root / 'edge-batches.db'}?mode=ro", uri=True) as db:
        (lease_id,) = db.execute(
            "SELECT lease_id FROM batches WHERE id = ?", (batch_id,)
        ).fetchone()
    assert lease_id

    # An unknown lease is no forgery (a legitimate worker's lease expires and is taken over):
    # it is answered lease_lost as before, and the connection lives on.
    conn = await attacker(stack, "worker-evil", pb.PEER_ROLE_WORKER)
    sent = await conn.send(pb.LeaseRenew(lease_id="lease_that_never_was"))
    answer = await asyncio.wait_for(conn.receive(), 5)
    assert answer.correlation_id == sent.message_id
    assert answer.WhichOneof("body") == "error", answer
    assert not conn.closed

    forgeries: list[tuple[object, str]] = [
        (pb.LeaseRenew(lease_id=lease_id), "foreign_lease"),
        (pb.BatchLineRequest(lease_id=lease_id, line_number=BATCH_LINES - 1), "foreign_lease"),
        (pb.LeaseRelease(lease_id=lease_id, finished=True), "foreign_lease"),
        (pb.LeaseRequest(worker_id="worker"), "foreign_worker"),
    ]
    for number, (body, _) in enumerate(forgeries):
        if number:
            conn = await attacker(stack, "worker-evil", pb.PEER_ROLE_WORKER)
        await conn.send(body)
        await assert_thrown_out(conn)

    # The real worker's batch runs to its end, every line exactly once.
    batch = await finished(sdk, batch_id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (BATCH_LINES, 0)
    assert batch.output_file_id
    output = (await sdk.files.content(batch.output_file_id)).text.splitlines()
    ids = sorted(json.loads(line)["custom_id"] for line in output if line)
    assert ids == sorted(f"victim-{i}" for i in range(BATCH_LINES))
    assert not any("leased to worker-evil" in line for line in edge.log)

    log = "".join(edge.log)
    assert "tried to renew a lease held by worker worker" in log
    assert lease_id not in log
    assert "refused worker worker-evil (certificate role worker)" in log
    after = await refusals(stack)
    for reason in ("foreign_lease", "foreign_worker"):
        expected = sum(1 for _, r in forgeries if r == reason)
        assert after[("worker", reason)] == before.get(("worker", reason), 0) + expected
    total = sum(after.values())
    print(f"\ninjection attempts refused on this edge so far: {total} {dict(after)}")
