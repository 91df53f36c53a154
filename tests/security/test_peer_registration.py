"""Who a peer registers as, and what a second connection of the same worker may do
(issue 29, item 8).

A registration names its role: a node or a worker. Any other (unset, or a number the
edge does not know) is refused, named in the edge's log and counted, and only that
connection closes; the holder of a node's certificate and token is not taken for a
node by leaving the role out.

A worker's leases belong to the connection they were granted on. Someone holding the
worker's certificate (or the worker dialling again before its old link is known dead)
opens a second connection: it gets only leases of its own, never frees or touches the
first one's, and the first one's batch goes on, leased once. Lease ids are the
handles a worker acts on its batch with: no service logs them at INFO.
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
BATCH_LINES = 32  # 32 lines x 500 ms over the worker's 4 slots: 4 s under one lease
REFUSALS = re.compile(
    r'iop_edge_peer_refusals_total\{reason="(\w+)",role="(\w+)",stage="(\w+)"\} (\S+)'
)
RENEWALS = re.compile(r"^iop_edge_batch_lease_renewals_total (\S+)$", re.MULTILINE)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as client:
        yield client


async def edge_metrics(stack: Stack) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.edge_admin}/metrics") as response:
            return await response.text()


async def refusals(stack: Stack) -> dict[tuple[str, str, str], int]:
    """The edge's node-port refusals by (stage, role, reason)."""
    found = REFUSALS.findall(await edge_metrics(stack))
    return {(stage, role, reason): int(float(n)) for reason, role, stage, n in found}


async def renewals(stack: Stack) -> int:
    match = RENEWALS.search(await edge_metrics(stack))
    return int(float(match.group(1))) if match else 0


async def node_token(stack: Stack, name: str) -> str:
    out = await stack.control_plane_cli("token", "issue", "--node", name)
    match = re.search(r"iopnt_\S+", out)
    assert match is not None
    return match.group(0)


async def connect(stack: Stack, name: str, role: int, token: str = "") -> tuple[Connection, Any]:
    """A connection with ``name``'s certificate and its registration's answer."""
    reader, writer = await open_client(stack.node_port, client_context(stack.tls(name)))
    conn = Connection(reader, writer, sender_id=name, heartbeat_interval=0)
    await conn.send(pb.RegisterRequest(peer_id=name, token=token, role=role))  # type: ignore[arg-type]
    answer = await asyncio.wait_for(conn.receive(), 10)
    return conn, answer


async def closed_by_the_edge(conn: Connection) -> None:
    """The edge closes the connection (nothing but an error frame before its end)."""
    try:
        async with asyncio.timeout(10):  # a TimeoutError fails the test: left open
            while True:
                envelope = await conn.receive()
                assert envelope.WhichOneof("body") == "error", envelope
    except ConnectionClosed:
        return
    finally:
        await conn.close()


@pytest.mark.parametrize("role", [pb.PEER_ROLE_UNSPECIFIED, 99], ids=["unset", "99"])
async def test_a_registration_with_an_unknown_role_is_refused(
    stack: Stack, sdk: AsyncOpenAI, role: int
) -> None:
    before = await refusals(stack)
    token = await node_token(stack, "node-fuzz")  # a node's real certificate and token
    conn, answer = await connect(stack, "node-fuzz", role, token)
    assert answer.WhichOneof("body") == "register_response", answer
    assert not answer.register_response.accepted, "a peer of no known role was admitted"
    shown = "PEER_ROLE_UNSPECIFIED" if role == pb.PEER_ROLE_UNSPECIFIED else str(role)
    assert answer.register_response.reason.startswith(f"unknown peer role {shown}:")
    await closed_by_the_edge(conn)

    line = await asyncio.wait_for(
        stack.services["edge"].wait_for_line(f"unknown peer role {shown}:"), 5
    )
    assert "refused node-fuzz at registration (unknown_role)" in line
    assert token not in "".join(stack.services["edge"].log)
    after = await refusals(stack)
    key = ("registration", "unknown", "unknown_role")
    assert after.get(key, 0) == before.get(key, 0) + 1

    # Only that connection: the same credentials with the node's role get in, and the
    # fleet serves as before.
    conn, answer = await connect(stack, "node-fuzz", pb.PEER_ROLE_NODE, token)
    assert answer.register_response.accepted, answer
    await conn.close()
    reply = await sdk.chat.completions.create(
        model="mock-small", messages=[{"role": "user", "content": "still here?"}], max_tokens=3
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


async def submit_batch(sdk: AsyncOpenAI) -> str:
    lines = [
        {
            "custom_id": f"first-{i}",
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
    upload = await sdk.files.create(file=("first.jsonl", data), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


async def finished(sdk: AsyncOpenAI, batch_id: str) -> Any:
    async with asyncio.timeout(60):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
            await asyncio.sleep(0.2)


def lease_of(stack: Stack, batch_id: str) -> str | None:
    """The batch's lease id, read from the edge's batch database (a reader beside it)."""
    with sqlite3.connect(f"file:{stack.root / 'edge-batches.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT lease_id FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return None if row is None else row[0]


async def test_a_second_worker_connection_takes_nothing_from_the_first(
    stack: Stack, sdk: AsyncOpenAI
) -> None:
    edge, worker = stack.services["edge"], stack.services["worker"]
    before = await refusals(stack)
    batch_id = await submit_batch(sdk)
    await asyncio.wait_for(edge.wait_for_line(f"batch {batch_id}: leased to worker"), 15)
    lease_id = lease_of(stack, batch_id)
    assert lease_id

    second, answer = await connect(stack, "worker", pb.PEER_ROLE_WORKER)
    assert answer.register_response.accepted, answer  # the certificate is the worker's
    sent = await second.send(pb.LeaseRequest(worker_id="worker"))
    grant = await asyncio.wait_for(second.receive(), 5)
    assert grant.correlation_id == sent.message_id
    assert grant.WhichOneof("body") == "lease_grant", grant
    assert grant.lease_grant.batch_id == "", "the second connection was handed the first's batch"
    assert lease_of(stack, batch_id) == lease_id  # still the first connection's lease
    await asyncio.wait_for(
        edge.wait_for_line("worker worker: a second connection registered from"), 5
    )

    # The first connection keeps renewing its lease while the second one lives.
    renewed = await renewals(stack)
    async with asyncio.timeout(15):
        while await renewals(stack) < renewed + 2:
            await second.send(pb.Heartbeat())  # keeps the second connection alive meanwhile
            await asyncio.sleep(0.2)
    assert lease_of(stack, batch_id) == lease_id

    # Knowing the first one's lease id, the second connection still cannot act on it.
    forgeries = [
        pb.LeaseRenew(lease_id=lease_id),
        pb.BatchLineRequest(lease_id=lease_id, line_number=BATCH_LINES - 1),
        pb.LeaseRelease(lease_id=lease_id, finished=True),
    ]
    for number, body in enumerate(forgeries):
        if number:
            second, answer = await connect(stack, "worker", pb.PEER_ROLE_WORKER)
            assert answer.register_response.accepted, answer
        await second.send(body)
        error = await asyncio.wait_for(second.receive(), 5)
        assert error.WhichOneof("body") == "error", error
        assert error.error.code == pb.ERROR_CODE_PERMISSION_DENIED, error
        assert "granted on another connection" in error.error.message
        await closed_by_the_edge(second)

    # The first connection's batch runs to its end under its one lease, each line once.
    batch = await finished(sdk, batch_id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (BATCH_LINES, 0)
    assert batch.output_file_id
    output = (await sdk.files.content(batch.output_file_id)).text.splitlines()
    ids = sorted(json.loads(line)["custom_id"] for line in output if line)
    assert ids == sorted(f"first-{i}" for i in range(BATCH_LINES))
    assert sum(f"batch {batch_id}: leased to" in line for line in edge.log) == 1
    assert not [line for line in worker.log if "lost" in line and batch_id in line]

    after = await refusals(stack)
    key = ("ownership", "worker", "foreign_session")
    assert after.get(key, 0) == before.get(key, 0) + len(forgeries)
    logs = "".join(line for service in stack.services.values() for line in service.log)
    assert lease_id not in logs, "a live lease id was logged"
