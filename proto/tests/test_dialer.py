"""The dial/register/reconnect loop against a real loopback edge over mTLS."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from loguru import logger
from prometheus_client import CollectorRegistry, Gauge

from iop_proto.connection import Connection
from iop_proto.dialer import Dialer, DialSettings, code_name
from iop_proto.testing import Pki, loopback_server
from iop_proto.v1 import runtime_pb2 as pb


class FakeEdge:
    """Answers each registration as told, then keeps or drops the connection."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers  # one a connection: "accept", "refuse", "error", "garbage"
        self.registrations: list[pb.RegisterRequest] = []
        self.drop = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            hello = await conn.receive()
            self.registrations.append(hello.register_request)
            answer = self.answers.pop(0) if self.answers else "accept"
            if answer == "error":
                error = pb.Error(code=pb.ERROR_CODE_PERMISSION_DENIED, message="not you")
                await conn.send(error, correlation_id=hello.message_id)
                return
            if answer == "garbage":
                await conn.send(pb.LeaseRequest(worker_id="?"), correlation_id=hello.message_id)
                await asyncio.sleep(3600)  # the dialer must end it
            accepted = answer == "accept"
            response = pb.RegisterResponse(
                accepted=accepted, reason="" if accepted else "go away", edge_id="edge-1"
            )
            await conn.send(response, correlation_id=hello.message_id)
            if accepted:
                await self.drop.wait()
                self.drop.clear()


class Probe(Dialer):
    """A dialer that records its hooks; ``_serve`` waits for the edge to hang up."""

    def __init__(self, port: int, pki: Pki, gauge: Gauge, broken: bool = False) -> None:
        dial = DialSettings(
            host="127.0.0.1",
            port=port,
            server_name=None,
            sender_id="node-a",
            register_timeout_s=5,
            initial_delay_s=0.01,
            max_delay_s=0.05,
        )
        super().__init__(dial, pki.client(), gauge)
        self.broken = broken
        self.served = 0
        self.disconnects = 0
        self.serving: asyncio.Queue[int] = asyncio.Queue()  # registrations, as each is served

    def _register_request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(peer_id="node-a", role=pb.PEER_ROLE_NODE, version="t")

    async def _accepted(self, conn: Connection, response: pb.RegisterResponse) -> str:
        return " (probe)"

    async def _serve(self, conn: Connection) -> None:
        self.served += 1
        self.serving.put_nowait(self.registrations)
        if self.broken:
            self.broken = False
            raise RuntimeError("a bug in serve")
        async for _ in conn:
            pass

    async def _disconnected(self) -> None:
        self.disconnects += 1


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lines.append, level="INFO", format="{message}")
    yield lines
    logger.remove(handler)


@pytest.fixture
def gauge() -> Gauge:
    return Gauge("edge_connected", "test", registry=CollectorRegistry())


async def wait_until_registered(probe: Probe, count: int) -> None:
    """Until the ``count``-th registration is being served."""
    async with asyncio.timeout(10):
        while await probe.serving.get() < count:
            pass
    assert probe.registered.is_set()


def value(gauge: Gauge) -> float:
    return gauge.collect()[0].samples[0].value


async def test_registers_serves_and_registers_again_after_a_drop(
    pki: Pki, gauge: Gauge, log: list[str]
) -> None:
    edge = FakeEdge([])
    async with loopback_server(edge.handle, pki.server()) as port:
        probe = Probe(port, pki, gauge)
        task = asyncio.create_task(probe.run())
        try:
            await wait_until_registered(probe, 1)
            assert value(gauge) == 1
            assert edge.registrations[0].peer_id == "node-a"
            edge.drop.set()
            await wait_until_registered(probe, 2)
            assert value(gauge) == 1
        finally:
            probe.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert probe.served >= 2
    assert probe.disconnects >= 1
    assert any("registered with edge edge-1 (probe)" in line for line in log)
    assert any("reconnecting to the edge in" in line for line in log)


@pytest.mark.parametrize(
    ("answer", "logged"),
    [
        ("refuse", "the edge refused the registration: go away"),
        ("error", "the edge refused the registration: not you (ERROR_CODE_PERMISSION_DENIED)"),
        ("garbage", "expected register_response, got lease_request"),
    ],
)
async def test_a_failed_registration_is_logged_and_retried(
    pki: Pki, gauge: Gauge, log: list[str], answer: str, logged: str
) -> None:
    edge = FakeEdge([answer])
    async with loopback_server(edge.handle, pki.server()) as port:
        probe = Probe(port, pki, gauge)
        task = asyncio.create_task(probe.run())
        try:
            await wait_until_registered(probe, 1)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert len(edge.registrations) == 2
    assert probe.served == 1
    assert any(logged in line for line in log)


async def test_a_bug_while_serving_ends_the_connection_not_the_loop(
    pki: Pki, gauge: Gauge, log: list[str]
) -> None:
    edge = FakeEdge([])
    async with loopback_server(edge.handle, pki.server()) as port:
        probe = Probe(port, pki, gauge, broken=True)
        task = asyncio.create_task(probe.run())
        try:
            await wait_until_registered(probe, 2)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert any("edge connection failed" in line for line in log)


async def test_an_unreachable_edge_is_retried_until_stopped(
    pki: Pki, gauge: Gauge, log: list[str]
) -> None:
    async with loopback_server(FakeEdge([]).handle, pki.server()) as port:
        pass  # closed again: nothing listens on this port now
    misses: asyncio.Queue[str] = asyncio.Queue()
    handler = logger.add(misses.put_nowait, filter=lambda r: "cannot reach" in r["message"])
    probe = Probe(port, pki, gauge)
    task = asyncio.create_task(probe.run())
    try:
        async with asyncio.timeout(10):
            for _ in range(2):  # two attempts, both failed
                await misses.get()
    finally:
        logger.remove(handler)
    probe.stop()
    async with asyncio.timeout(5):
        await task  # returns on its own once stopped
    assert probe.registrations == 0
    assert value(gauge) == 0
    assert probe.disconnects == 0  # no connection, nothing to clean up


def test_code_name_knows_the_codes_and_passes_unknown_ones_through() -> None:
    assert code_name(pb.ERROR_CODE_NOT_FOUND) == "ERROR_CODE_NOT_FOUND"
    assert code_name(9999) == "9999"
