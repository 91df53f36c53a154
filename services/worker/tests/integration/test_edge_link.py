"""The worker against a fake edge over real mTLS: register, lease, lines, release, reconnect."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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
from iop_worker.entrypoints.edge_link import EdgeLink
from iop_worker.settings import WorkerSettings

TOTAL_LINES = 10


@dataclass
class Session:
    """One registered worker connection, seen from the edge."""

    number: int
    conn: Connection
    register: pb.RegisterRequest
    lines: list[int] = field(default_factory=list)
    held: list[pb.Envelope] = field(default_factory=list)  # line requests not answered yet


class FakeEdge:
    """The edge's side of the worker protocol, just enough to drive a real worker.

    It grants ``batches`` leases of ``TOTAL_LINES`` lines (from line 0), answers
    every line with 200 and renewals with a grant; after the last grant it
    answers lease requests with nothing at all. Subclasses change one step.
    """

    def __init__(self, batches: int = 1) -> None:
        self.batches = batches
        self.registrations: list[pb.RegisterRequest] = []
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()
        self.lease_requests: asyncio.Queue[int] = asyncio.Queue()  # the session number of each
        self.releases: list[tuple[int, str, bool]] = []
        self.released = asyncio.Event()
        self._grants = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            hello = await conn.receive()
            register = hello.register_request
            self.registrations.append(register)
            accepted = self.accept(conn, register)
            await conn.send(
                pb.RegisterResponse(
                    accepted=accepted,
                    reason="" if accepted else "not now",
                    heartbeat_interval_ms=30_000,
                    edge_id="test-edge",
                ),
                correlation_id=hello.message_id,
            )
            if not accepted:
                return
            session = Session(len(self.registrations), conn, register)
            await self.sessions.put(session)
            with contextlib.suppress(ConnectionClosed):
                async for envelope in conn:
                    await self.on_message(session, envelope)

    def accept(self, conn: Connection, register: pb.RegisterRequest) -> bool:
        return (
            conn.peer is not None
            and conn.peer.role == "worker"
            and conn.peer.name == register.peer_id
            and register.role == pb.PEER_ROLE_WORKER
        )

    async def on_message(self, session: Session, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "lease_request":
            assert envelope.lease_request.worker_id == "worker"
            await self.lease_requests.put(session.number)
            if self._grants < self.batches:
                self._grants += 1
                grant = pb.LeaseGrant(
                    batch_id="batch-1",
                    lease_id=f"lease-{self._grants}",
                    expires_at_unix_ms=int(time.time() * 1000) + 60_000,
                    endpoint="/v1/chat/completions",
                    next_line=0,
                    total_lines=TOTAL_LINES,
                )
                await session.conn.send(grant, correlation_id=envelope.message_id)
        elif kind == "batch_line_request":
            session.lines.append(envelope.batch_line_request.line_number)
            await self.on_line(session, envelope)
        elif kind == "lease_renew":
            await self.on_renew(session, envelope)
        elif kind == "lease_release":
            release = envelope.lease_release
            self.releases.append((session.number, release.lease_id, release.finished))
            self.released.set()
        else:
            raise AssertionError(f"unexpected {kind} from the worker")

    async def on_line(self, session: Session, envelope: pb.Envelope) -> None:
        await answer_line(session.conn, envelope)

    async def on_renew(self, session: Session, envelope: pb.Envelope) -> None:
        grant = pb.LeaseGrant(
            lease_id=envelope.lease_renew.lease_id,
            expires_at_unix_ms=int(time.time() * 1000) + 60_000,
        )
        await session.conn.send(grant, correlation_id=envelope.message_id)


async def answer_line(conn: Connection, envelope: pb.Envelope, status_code: int = 200) -> None:
    request = envelope.batch_line_request
    result = pb.BatchLineResult(
        lease_id=request.lease_id,
        line_number=request.line_number,
        custom_id=f"request-{request.line_number}",
        status_code=status_code,
        response_json=b'{"object": "chat.completion"}',
    )
    await conn.send(result, correlation_id=envelope.message_id)


@dataclass
class Pki:
    edge: TlsSettings
    worker: TlsSettings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = trustme.CA()
    directory = tmp_path_factory.mktemp("pki")
    return Pki(
        edge=write_identity(ca, directory, "edge", "edge"),
        worker=write_identity(ca, directory, "worker", "worker"),
    )


@contextlib.asynccontextmanager
async def running_worker(
    pki: Pki, edge: FakeEdge, **overrides: object
) -> AsyncIterator[tuple[EdgeLink, CollectorRegistry]]:
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        settings = WorkerSettings.model_validate(
            {
                "service_id": "worker",
                "tls": pki.worker.model_dump(),
                "edge": {"host": "127.0.0.1", "port": port, "server_name": "localhost"},
                "concurrency": 4,
                "poll_interval_s": 0.05,
                "answer_timeout_s": 0.5,
                "reconnect": {"initial_s": 0.05, "max_s": 0.2},
                **overrides,
            }
        )
        registry = CollectorRegistry()
        admin = AdminServer("worker", registry, host="127.0.0.1", port=0)
        async with build(settings, registry, admin) as link:
            yield link, registry


async def next_session(edge: FakeEdge) -> Session:
    return await asyncio.wait_for(edge.sessions.get(), 10)


async def lease_request_on(edge: FakeEdge, session: Session) -> None:
    """Wait until the worker asks for a lease on ``session`` (it is done with what it had)."""
    async with asyncio.timeout(10):
        while await edge.lease_requests.get() != session.number:
            pass


async def test_runs_a_batch_releases_it_and_registers_again_after_a_drop(pki: Pki) -> None:
    edge = FakeEdge()
    async with running_worker(pki, edge) as (link, registry):
        first = await next_session(edge)
        assert first.register.peer_id == "worker"
        assert first.register.role == pb.PEER_ROLE_WORKER
        assert first.register.token == ""
        assert first.conn.peer is not None
        assert (first.conn.peer.name, first.conn.peer.role) == ("worker", "worker")

        await asyncio.wait_for(edge.released.wait(), 10)
        assert sorted(first.lines) == list(range(TOTAL_LINES))
        assert len(first.lines) == TOTAL_LINES  # each line exactly once
        assert edge.releases == [(1, "lease-1", True)]
        assert registry.get_sample_value("iop_worker_lines_total", {"outcome": "done"}) == 10
        assert registry.get_sample_value("iop_worker_batches_total", {"outcome": "finished"}) == 1
        assert registry.get_sample_value("iop_worker_edge_connected") == 1

        await first.conn.close()  # the edge drops the worker
        second = await next_session(edge)
        assert second.register.peer_id == "worker"
        await lease_request_on(edge, second)  # registered, and back at work
        assert link.registered.is_set()
        assert link.registrations == 2
        assert len(edge.registrations) == 2
        assert second.lines == []  # the fake edge granted nothing more


class DropsMidBatch(FakeEdge):
    """Drops the first connection once four lines are in flight (never answering them)."""

    async def on_line(self, session: Session, envelope: pb.Envelope) -> None:
        if session.number > 1:
            await answer_line(session.conn, envelope)
            return
        session.held.append(envelope)
        if len(session.held) == 4:
            await session.conn.close()


async def test_a_dropped_connection_abandons_the_batch_without_release(pki: Pki) -> None:
    edge = DropsMidBatch(batches=2)
    async with running_worker(pki, edge) as (_, registry):
        first = await next_session(edge)
        second = await next_session(edge)
        assert sorted(first.lines) == [0, 1, 2, 3]  # the bound held, then the link went
        # the edge leases the batch again from its first unfinished line; this time it ends
        await asyncio.wait_for(edge.released.wait(), 10)
        assert edge.releases == [(second.number, "lease-2", True)]
        assert sorted(second.lines) == list(range(TOTAL_LINES))
        assert registry.get_sample_value("iop_worker_batches_total", {"outcome": "lost"}) == 1


class CancelsTheBatch(FakeEdge):
    """Holds the lines until the first renewal, refuses it (NOT_FOUND), then answers them."""

    async def on_line(self, session: Session, envelope: pb.Envelope) -> None:
        session.held.append(envelope)

    async def on_renew(self, session: Session, envelope: pb.Envelope) -> None:
        error = pb.Error(code=pb.ERROR_CODE_NOT_FOUND, message="batch cancelled")
        await session.conn.send(error, correlation_id=envelope.message_id)
        for held in session.held:
            await answer_line(session.conn, held)


async def test_a_refused_renewal_stops_new_lines_and_skips_the_release(pki: Pki) -> None:
    edge = CancelsTheBatch()
    overrides = {"concurrency": 2, "lease_renew_interval_s": 0.05}
    async with running_worker(pki, edge, **overrides) as (_, registry):
        session = await next_session(edge)
        await lease_request_on(edge, session)  # the grant
        await lease_request_on(edge, session)  # done with the batch: asking for the next
        assert sorted(session.lines) == [0, 1]
        assert edge.releases == []
        assert registry.get_sample_value("iop_worker_leases_lost_total") == 1
        assert registry.get_sample_value("iop_worker_lines_total", {"outcome": "done"}) == 2


class RefusesFirst(FakeEdge):
    def accept(self, conn: Connection, register: pb.RegisterRequest) -> bool:
        return len(self.registrations) > 1 and super().accept(conn, register)


async def test_a_refused_registration_is_retried(pki: Pki) -> None:
    edge = RefusesFirst(batches=0)
    async with running_worker(pki, edge) as (link, _):
        session = await next_session(edge)
        assert session.number == 2
        await lease_request_on(edge, session)
        assert link.registrations == 1
