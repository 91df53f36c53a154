"""The connection object over real mTLS sockets: faults close one connection, heartbeats."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed, HeartbeatTimeout, ProtocolError, UnparsableFrame
from iop_proto.framing import HEADER, encode_frame, read_frame
from iop_proto.testing import Pki, loopback_server, open_client
from iop_proto.v1 import runtime_pb2 as pb

PING = pb.Envelope(cancel_request=pb.CancelRequest(run_id="ping"))


class EchoServer:
    """Echoes every envelope; records the fault each connection ended with."""

    def __init__(self) -> None:
        self.faults: list[BaseException | None] = []
        self.ended = asyncio.Condition()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fault: BaseException | None = None
        async with Connection(
            reader, writer, sender_id="edge", heartbeat_interval=0, max_frame_size=1024
        ) as conn:
            try:
                async for envelope in conn:
                    await conn.send_envelope(envelope)
            except (ProtocolError, ConnectionError) as exc:
                fault = exc
        async with self.ended:
            self.faults.append(fault)
            self.ended.notify_all()

    async def wait_for_faults(self, count: int) -> None:
        async with self.ended:
            await asyncio.wait_for(self.ended.wait_for(lambda: len(self.faults) >= count), 5)


async def echo_once(conn: Connection) -> None:
    await conn.send_envelope(PING)
    answer = await asyncio.wait_for(conn.receive(), 5)
    assert answer.cancel_request.run_id == "ping"


async def test_garbage_closes_only_that_connection_with_an_error_frame(pki: Pki) -> None:
    server = EchoServer()
    async with loopback_server(server.handle, pki.server()) as port:
        good_reader, good_writer = await open_client(port, pki.client())
        async with Connection(
            good_reader, good_writer, sender_id="good", heartbeat_interval=0
        ) as good:
            await echo_once(good)

            bad_reader, bad_writer = await open_client(port, pki.client())
            garbage = b"\x00\x01garbage!"
            bad_writer.write(HEADER.pack(len(garbage)) + garbage)
            await bad_writer.drain()
            error = await asyncio.wait_for(read_frame(bad_reader), 5)
            assert error.error.code == pb.ERROR_CODE_BAD_FRAME
            assert "Envelope" in error.error.message
            assert await asyncio.wait_for(bad_reader.read(), 5) == b""  # then closed
            bad_writer.close()

            await server.wait_for_faults(1)
            assert isinstance(server.faults[0], UnparsableFrame)
            await echo_once(good)  # the other connection is unaffected


async def test_oversize_length_gets_frame_too_large_error(pki: Pki) -> None:
    server = EchoServer()
    async with loopback_server(server.handle, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        writer.write(HEADER.pack(10_000_000))
        await writer.drain()
        error = await asyncio.wait_for(read_frame(reader), 5)
        assert error.error.code == pb.ERROR_CODE_FRAME_TOO_LARGE
        writer.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=2048))
async def test_server_survives_random_streams(pki: Pki, data: bytes) -> None:
    server = EchoServer()
    async with loopback_server(server.handle, pki.server()) as port:
        _, writer = await open_client(port, pki.client())
        writer.write(data)
        await writer.drain()
        # TLS cannot half-close: hang up, and the server must end that connection
        # (a typed fault for bad or truncated frames, a clean end for valid ones).
        writer.close()
        await server.wait_for_faults(1)
        fault = server.faults[0]
        assert fault is None or isinstance(fault, ProtocolError | ConnectionError)
        good_reader, good_writer = await open_client(port, pki.client())
        async with Connection(
            good_reader, good_writer, sender_id="g", heartbeat_interval=0
        ) as good:
            await echo_once(good)


async def test_heartbeats_keep_an_idle_connection_alive(pki: Pki) -> None:
    interval = 0.05
    server_conn: list[Connection] = []
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=interval) as c:
            server_conn.append(c)
            receiving = asyncio.create_task(c.receive())
            await release.wait()
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)

    async with loopback_server(handler, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        async with Connection(reader, writer, sender_id="node", heartbeat_interval=interval) as c:
            receiving = asyncio.create_task(c.receive())
            # idle for ten intervals, far past the three-missed limit
            done, _ = await asyncio.wait({receiving}, timeout=interval * 10)
            assert not done, "the connection died although both sides sent heartbeats"
            assert not c.closed
            assert not server_conn[0].closed
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
        release.set()


async def test_silent_peer_is_declared_dead_after_missed_heartbeats(pki: Pki) -> None:
    interval = 0.05
    outcome: list[BaseException] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=interval) as c:
            try:
                await c.receive()
            except (ProtocolError, ConnectionClosed) as exc:
                outcome.append(exc)

    async with loopback_server(handler, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())  # a raw peer that never speaks
        frames = []
        while True:
            try:
                frames.append(await asyncio.wait_for(read_frame(reader), 5))
            except ConnectionClosed:
                break
        writer.close()
    kinds = [f.WhichOneof("body") for f in frames]
    assert kinds[-1] == "error"
    assert frames[-1].error.code == pb.ERROR_CODE_HEARTBEAT_TIMEOUT
    assert set(kinds[:-1]) <= {"heartbeat"}
    assert len(outcome) == 1
    assert isinstance(outcome[0], HeartbeatTimeout)


async def test_send_after_close_raises_connection_closed(pki: Pki) -> None:
    server = EchoServer()
    async with loopback_server(server.handle, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        conn = Connection(reader, writer, sender_id="n", heartbeat_interval=0)
        await conn.close()
        await conn.close()  # idempotent
        with pytest.raises(ConnectionClosed):
            await conn.send(pb.Heartbeat())
        with pytest.raises(ConnectionClosed):
            await conn.receive()


async def test_peer_error_frame_is_delivered_then_close_is_reported(pki: Pki) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = pb.Error(code=pb.ERROR_CODE_UNAUTHENTICATED, message="token revoked")
        writer.write(encode_frame(pb.Envelope(error=body)))
        await writer.drain()

    async with loopback_server(handler, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        async with Connection(reader, writer, sender_id="n", heartbeat_interval=0) as conn:
            first = await conn.receive()
            assert first.error.code == pb.ERROR_CODE_UNAUTHENTICATED
            with pytest.raises(ConnectionClosed) as info:
                await conn.receive()
            assert info.value.error is not None
            assert info.value.error.message == "token revoked"


async def test_send_refuses_a_non_body_message() -> None:
    reader = asyncio.StreamReader()

    class _Writer:
        def get_extra_info(self, name: str) -> None:
            return None

    conn = Connection(reader, _Writer(), sender_id="x", heartbeat_interval=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Usage"):
        conn.envelope(pb.Usage())
