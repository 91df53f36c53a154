"""The edge's control-plane link (on ``iop_proto.dialer``) against a loopback control-plane.

A fake control-plane over real mTLS answers the edge's hello with a fleet config,
answers authorizations, pushes, and hangs up when told; the link must apply each
config, keep the last one on disk, answer ``authorize`` only while it is up, send
the node report, and dial again after a loss with the version it already holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trustme
from loguru import logger
from prometheus_client import CollectorRegistry, Gauge

from iop_edge.adapters.control_plane import ControlPlaneClient
from iop_edge.errors import ControlPlaneUnavailable
from iop_proto.connection import Connection
from iop_proto.testing import Pki, loopback_server, write_identity
from iop_proto.tls import server_context
from iop_proto.v1 import runtime_pb2 as pb


class FakeControlPlane:
    """Serves one fleet config version per connection, then whatever the test asks."""

    def __init__(self) -> None:
        self.hellos: list[pb.EdgeHello] = []
        self.reports: asyncio.Queue[pb.NodeStatusReport] = asyncio.Queue()
        self.version = 1
        self.drop = asyncio.Event()
        self.conns: asyncio.Queue[Connection] = asyncio.Queue()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="cp", heartbeat_interval=0) as conn:
            hello = await conn.receive()
            self.hellos.append(hello.edge_hello)
            await conn.send(pb.FleetConfig(version=self.version, accepts_node_status=True))
            self.conns.put_nowait(conn)
            reading = asyncio.create_task(self._answer(conn))
            try:
                await self.drop.wait()
                self.drop.clear()
            finally:
                reading.cancel()

    async def _answer(self, conn: Connection) -> None:
        async for envelope in conn:
            kind = envelope.WhichOneof("body")
            if kind == "authorize_node_request":
                request = envelope.authorize_node_request
                answer = pb.AuthorizeNodeResponse(accepted=request.token == "good")
                await conn.send(answer, correlation_id=envelope.message_id)
            elif kind == "node_status_report":
                self.reports.put_nowait(envelope.node_status_report)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lines.append, level="INFO", format="{message}")
    yield lines
    logger.remove(handler)


@pytest.fixture
def log_queue() -> Iterator[asyncio.Queue[str]]:
    """Log lines as they are written, for a test to wait on."""
    lines: asyncio.Queue[str] = asyncio.Queue()
    handler = logger.add(lines.put_nowait, level="INFO", format="{message}")
    yield lines
    logger.remove(handler)


def gauge_value(gauge: Gauge) -> float:
    return gauge.collect()[0].samples[0].value


class Link:
    """A ``ControlPlaneClient`` as the edge's bootstrap builds it, and what it was told."""

    def __init__(self, port: int, pki: Pki, cache_file: Path) -> None:
        self.gauge = Gauge("cp_connected", "test", registry=CollectorRegistry())
        self.applied: asyncio.Queue[int] = asyncio.Queue()
        self.client = ControlPlaneClient(
            host="127.0.0.1",
            port=port,
            server_name=None,
            edge_id="edge-1",
            version="t",
            tls=pki.client(),
            cache_file=cache_file,
            on_fleet=self._on_fleet,
            heartbeat_interval_s=0,
            reconnect_max_s=0.2,
            authorize_timeout_s=5,
            link_gauge=self.gauge,
        )

    async def _on_fleet(self, config: pb.FleetConfig) -> None:
        self.applied.put_nowait(config.version)


@pytest.fixture
async def running(pki: Pki, tmp_path: Path) -> AsyncIterator[tuple[FakeControlPlane, Link]]:
    control_plane = FakeControlPlane()
    async with loopback_server(control_plane.handle, pki.server()) as port:
        link = Link(port, pki, tmp_path / "fleet.cache")
        task = asyncio.create_task(link.client.run())
        try:
            yield control_plane, link
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_applies_the_config_answers_authorizations_and_reports_nodes(
    running: tuple[FakeControlPlane, Link], tmp_path: Path
) -> None:
    control_plane, link = running
    async with asyncio.timeout(10):
        assert await link.applied.get() == 1
        await link.client.registered.wait()
    assert gauge_value(link.gauge) == 1
    assert control_plane.hellos[0].known_config_version == 0
    assert control_plane.hellos[0].edge_id == "edge-1"
    first_report = await asyncio.wait_for(control_plane.reports.get(), 10)
    assert list(first_report.nodes) == []  # the latest report, sent on connect

    yes = await link.client.authorize("node-a", "good", "node-a")
    no = await link.client.authorize("node-a", "bad", "node-a")
    assert (yes.accepted, no.accepted) == (True, False)

    link.client.report_nodes(pb.NodeStatusReport(nodes=[pb.NodeStatus(node_id="node-a")]))
    report = await asyncio.wait_for(control_plane.reports.get(), 10)
    assert [node.node_id for node in report.nodes] == ["node-a"]

    cached = pb.FleetConfig()  # saved before the link counts as up
    cached.ParseFromString((tmp_path / "fleet.cache").read_bytes())
    assert cached.version == 1


async def test_a_lost_link_refuses_authorizations_and_dials_again_with_its_version(
    running: tuple[FakeControlPlane, Link], log: list[str]
) -> None:
    control_plane, link = running
    await asyncio.wait_for(link.client.registered.wait(), 10)
    control_plane.version = 2
    control_plane.drop.set()
    async with asyncio.timeout(10):
        assert await link.applied.get() == 1
        assert await link.applied.get() == 2  # the second connection's config
        await link.client.registered.wait()
    assert control_plane.hellos[1].known_config_version == 1
    assert link.client.registrations == 2
    assert gauge_value(link.gauge) == 1
    assert any("reconnecting to the control-plane" in line for line in log)
    assert any("registered with the control-plane (config version 2)" in line for line in log)


async def test_authorize_fails_closed_while_the_link_is_down(pki: Pki, tmp_path: Path) -> None:
    async with loopback_server(FakeControlPlane().handle, pki.server()) as port:
        pass  # the port is closed again: nothing listens there
    link = Link(port, pki, tmp_path / "fleet.cache")
    task = asyncio.create_task(link.client.run())
    try:
        with pytest.raises(ControlPlaneUnavailable, match="unreachable"):
            await link.client.authorize("node-a", "good", "node-a")
        assert gauge_value(link.gauge) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_control_plane_certificate_that_does_not_fit_is_logged_and_dialed_again(
    pki: Pki, tmp_path: Path, log_queue: asyncio.Queue[str]
) -> None:
    stranger = write_identity(trustme.CA(), tmp_path, "cp", "edge")  # another CA
    async with loopback_server(FakeControlPlane().handle, server_context(stranger)) as port:
        link = Link(port, pki, tmp_path / "fleet.cache")
        task = asyncio.create_task(link.client.run())
        try:
            seen: list[str] = []
            async with asyncio.timeout(20):
                while sum("reconnecting to the control-plane" in line for line in seen) < 2:
                    seen.append(await log_queue.get())
            assert not task.done()  # the edge keeps serving its cache and keeps trying
            assert any(line.startswith("control-plane at 127.0.0.1") for line in seen)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class HeldLink(Link):
    """A link whose edge takes its time applying a config: until ``release`` is set."""

    def __init__(self, port: int, pki: Pki, cache_file: Path) -> None:
        super().__init__(port, pki, cache_file)
        self.applying, self.release = asyncio.Event(), asyncio.Event()

    async def _on_fleet(self, config: pb.FleetConfig) -> None:
        self.applying.set()
        await self.release.wait()


async def test_an_ask_while_the_handshake_s_config_is_applied_is_answered(
    pki: Pki, tmp_path: Path
) -> None:
    """The edge shows the handshake's config while it applies it (before the registration
    counts): an authorization asked in that moment waits for its answer instead of being
    told the control-plane is unreachable."""
    async with loopback_server(FakeControlPlane().handle, pki.server()) as port:
        link = HeldLink(port, pki, tmp_path / "fleet.cache")
        task = asyncio.create_task(link.client.run())
        try:
            await asyncio.wait_for(link.applying.wait(), 10)
            asking = asyncio.create_task(link.client.authorize("node-a", "good", "node-a"))
            await asyncio.sleep(0.2)  # time for the answer to come; the link is not serving yet
            assert not asking.done()
            assert not link.client.registered.is_set()
            link.release.set()
            answer = await asyncio.wait_for(asking, 10)
            assert answer.accepted
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
