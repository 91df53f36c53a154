"""The worker and two test edges over real mTLS: it learns the second edge from the first
edge's pushed list, links to it, and leases from both (one lease loop per link)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme
from prometheus_client import CollectorRegistry

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed
from iop_proto.service import AdminServer
from iop_proto.testing import loopback_server, write_identity
from iop_proto.tls import TlsSettings, server_context
from iop_proto.v1 import runtime_pb2 as pb
from iop_worker.bootstrap import build
from iop_worker.settings import WorkerSettings

LINES = 5


class BatchEdge:
    """An edge with one batch of its own to lease, which lists ``edges`` to its peers."""

    def __init__(self, edge_id: str) -> None:
        self.edge_id = edge_id
        self.port = 0
        self.edges: list[pb.EdgeEndpoint] = []
        self.registrations: list[pb.RegisterRequest] = []
        self.connections: asyncio.Queue[Connection] = asyncio.Queue()
        self.lines: list[int] = []
        self.finished = asyncio.Event()
        self._granted = False

    @property
    def endpoint(self) -> pb.EdgeEndpoint:
        return pb.EdgeEndpoint(
            edge_id=self.edge_id, host="127.0.0.1", port=self.port, server_name="localhost"
        )

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id=self.edge_id, heartbeat_interval=0) as conn:
            hello = await conn.receive()
            register = hello.register_request
            self.registrations.append(register)
            answer = pb.RegisterResponse(
                accepted=True, heartbeat_interval_ms=30_000, edge_id=self.edge_id
            )
            if register.follows_edges:
                answer.edges.extend(self.edges)
            await conn.send(answer, correlation_id=hello.message_id)
            await self.connections.put(conn)
            with contextlib.suppress(ConnectionClosed):
                async for envelope in conn:
                    await self.on_message(conn, envelope)

    async def on_message(self, conn: Connection, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "lease_request":
            grant = pb.LeaseGrant()
            if not self._granted:
                self._granted = True
                grant = pb.LeaseGrant(
                    batch_id=f"batch-of-{self.edge_id}",
                    lease_id=f"lease-of-{self.edge_id}",
                    expires_at_unix_ms=int(time.time() * 1000) + 60_000,
                    endpoint="/v1/chat/completions",
                    total_lines=LINES,
                )
            await conn.send(grant, correlation_id=envelope.message_id)
        elif kind == "batch_line_request":
            request = envelope.batch_line_request
            assert request.lease_id == f"lease-of-{self.edge_id}"  # this edge's lease only
            self.lines.append(request.line_number)
            result = pb.BatchLineResult(
                lease_id=request.lease_id,
                line_number=request.line_number,
                custom_id=f"{self.edge_id}-{request.line_number}",
                status_code=200,
                response_json=b'{"object": "chat.completion"}',
            )
            await conn.send(result, correlation_id=envelope.message_id)
        elif kind == "lease_release":
            assert envelope.lease_release.finished
            self.finished.set()
        elif kind != "lease_renew":
            raise AssertionError(f"unexpected {kind} from the worker")

    async def list_edges(self, conn: Connection, edges: list[pb.EdgeEndpoint]) -> None:
        """Push a changed list, as the real edge does (no correlation: not an answer)."""
        self.edges = edges
        await conn.send(pb.RegisterResponse(accepted=True, edge_id=self.edge_id, edges=edges))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsSettings, TlsSettings]:
    ca = trustme.CA()
    directory: Path = tmp_path_factory.mktemp("pki")
    return write_identity(ca, directory, "edge", "edge"), write_identity(
        ca, directory, "worker", "worker"
    )


@contextlib.asynccontextmanager
async def two_edges(edge_tls: TlsSettings) -> AsyncIterator[tuple[BatchEdge, BatchEdge]]:
    a, b = BatchEdge("edge-a"), BatchEdge("edge-b")
    context = server_context(edge_tls)
    async with loopback_server(a.handle, context) as a.port:
        async with loopback_server(b.handle, context) as b.port:
            yield a, b


async def test_the_worker_learns_an_edge_from_a_push_and_leases_from_both(
    pki: tuple[TlsSettings, TlsSettings],
) -> None:
    edge_tls, worker_tls = pki
    async with two_edges(edge_tls) as (a, b):
        a.edges = [a.endpoint]  # at first edge-a knows only itself
        b.edges = [a.endpoint, b.endpoint]
        settings = WorkerSettings.model_validate(
            {
                "service_id": "worker",
                "tls": worker_tls.model_dump(),
                "edge": {"host": "127.0.0.1", "port": a.port, "server_name": "localhost"},
                "poll_interval_s": 0.05,
                "answer_timeout_s": 2,
                "reconnect": {"initial_s": 0.05, "max_s": 0.2},
            }
        )
        registry = CollectorRegistry()
        admin = AdminServer("worker", registry, host="127.0.0.1", port=0)
        async with build(settings, registry, admin) as links:
            at_a = await asyncio.wait_for(a.connections.get(), 10)
            assert a.registrations[0].follows_edges
            await asyncio.wait_for(a.finished.wait(), 10)  # edge-a's batch, line by line
            assert sorted(a.lines) == list(range(LINES))

            await a.list_edges(at_a, [a.endpoint, b.endpoint])  # edge-b joined the fleet
            await asyncio.wait_for(b.connections.get(), 10)
            await asyncio.wait_for(b.finished.wait(), 10)  # leased and run on its own link
            assert sorted(b.lines) == list(range(LINES))
            assert len(a.registrations) == 1  # the seed, listed by edge-b too, dialled once
            assert links.registered.is_set()
            assert registry.get_sample_value("iop_worker_edge_connected") == 2
