"""The connection object over real mTLS sockets: faults close one connection, heartbeats."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_proto.connection import DEFER_AT_MOST, Connection
from iop_proto.errors import ConnectionClosed, HeartbeatTimeout, ProtocolError, UnparsableFrame
from iop_proto.framing import HEADER, FrameReadTimeout, encode_frame, read_frame
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


class SlowlorisServer:
    """A server whose connections bound each frame's payload to ``timeout`` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.received: list[pb.Envelope] = []
        self.faults: list[BaseException] = []
        self.ended = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(
            reader, writer, sender_id="edge", heartbeat_interval=0, frame_read_timeout=self.timeout
        ) as conn:
            try:
                async for envelope in conn:
                    self.received.append(envelope)
            except ProtocolError as exc:
                self.faults.append(exc)
        self.ended.set()


async def trickle(writer: asyncio.StreamWriter, data: bytes, pause: float) -> None:
    for index in range(len(data)):
        writer.write(data[index : index + 1])
        await writer.drain()
        await asyncio.sleep(pause)


@pytest.mark.parametrize("whole_frames_first", [0, 1])
async def test_a_half_frame_trickled_slower_than_the_frame_timeout_is_cut(
    pki: Pki, whole_frames_first: int
) -> None:
    """After a whole frame the watchdog is already armed for its deadline: it must
    re-arm for the slow frame's own deadline, not cut it early."""
    server = SlowlorisServer(timeout=0.3)
    frame = encode_frame(PING)
    async with loopback_server(server.handle, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        loop = asyncio.get_running_loop()
        for _ in range(whole_frames_first):
            writer.write(frame)
            await asyncio.sleep(0.2)
        started = loop.time()
        # the header at once, then one payload byte every 0.1 s: 1.5 s for the whole frame
        sender = asyncio.create_task(trickle(writer, frame[HEADER.size :], 0.1))
        writer.write(frame[: HEADER.size])
        error = await asyncio.wait_for(read_frame(reader), 5)
        took = loop.time() - started
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
        await asyncio.wait_for(server.ended.wait(), 5)
    assert error.error.code == pb.ERROR_CODE_BAD_FRAME
    assert "did not arrive within 0.3s" in error.error.message
    assert 0.3 <= took < 5.0  # not before the 0.3 s timeout; the bound is the wait's
    assert len(server.received) == whole_frames_first
    assert len(server.faults) == 1
    assert isinstance(server.faults[0], FrameReadTimeout)
    assert server.faults[0].length == len(frame) - HEADER.size


async def test_slow_frames_within_the_timeout_and_idle_gaps_are_fine(pki: Pki) -> None:
    server = SlowlorisServer(timeout=0.5)
    frame = encode_frame(PING)
    async with loopback_server(server.handle, pki.server()) as port:
        _, writer = await open_client(port, pki.client())
        for _ in range(3):
            # each payload takes ~0.2 s, the three frames ~1 s in all, with idle gaps
            # between frames longer than the timeout: none of it is a fault
            writer.write(frame[: HEADER.size])
            await trickle(writer, frame[HEADER.size :], 0.2 / len(frame))
            await asyncio.sleep(0.6)
        writer.close()
        await asyncio.wait_for(server.ended.wait(), 5)
    assert len(server.received) == 3
    assert server.faults == []


async def test_an_outside_deadline_on_a_half_frame_stays_the_callers(pki: Pki) -> None:
    """The frame watchdog turns only its own cancel into ``FrameReadTimeout``: a caller's
    ``wait_for`` around ``receive()`` (the edge's registration deadline) still times out."""
    outcome: list[BaseException] = []
    done = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(
            reader, writer, sender_id="edge", heartbeat_interval=0, frame_read_timeout=5
        )
        try:
            await asyncio.wait_for(conn.receive(), 0.2)
        except BaseException as exc:  # recorded, whatever it is
            outcome.append(exc)
        finally:
            await conn.close()
            done.set()

    async with loopback_server(handler, pki.server()) as port:
        _, writer = await open_client(port, pki.client())
        writer.write(HEADER.pack(100) + b"\0")  # half a frame, then silence
        await asyncio.wait_for(done.wait(), 5)
        writer.close()
    assert len(outcome) == 1
    assert type(outcome[0]) is TimeoutError


class Recorder:
    """Keeps what one connection received, until it closes."""

    def __init__(self) -> None:
        self.run_ids: list[str] = []
        self.done = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            async for envelope in conn:
                self.run_ids.append(envelope.cancel_request.run_id)
        self.done.set()


def counting_writes(writer: asyncio.StreamWriter) -> list[int]:
    """Record the size of each write the connection makes on ``writer``."""
    sizes: list[int] = []
    write = writer.write

    def counted(data: bytes) -> None:
        sizes.append(len(data))
        write(data)

    writer.write = counted  # type: ignore[method-assign]
    return sizes


def cancel(run_id: str) -> pb.CancelRequest:
    return pb.CancelRequest(run_id=run_id)


@pytest.mark.parametrize("ending", ["pass ends", "plain send", "close"])
async def test_deferred_frames_leave_together_in_order(pki: Pki, ending: str) -> None:
    recorder = Recorder()
    async with loopback_server(recorder.handle, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        writes = counting_writes(writer)
        conn = Connection(reader, writer, sender_id="node", heartbeat_interval=0)
        for n in range(3):
            await conn.send(cancel(f"d{n}"), defer=True)
        assert writes == []  # nothing left before the end of this loop pass
        if ending == "pass ends":
            await asyncio.sleep(0.01)
            await conn.send(cancel("after"))
        elif ending == "plain send":
            await conn.send(cancel("after"))  # takes the waiting ones along, first
        await conn.close()
        await asyncio.wait_for(recorder.done.wait(), 5)
    expected = ["d0", "d1", "d2"] + ([] if ending == "close" else ["after"])
    assert recorder.run_ids == expected
    assert len(writes) == {"pass ends": 2, "plain send": 1, "close": 1}[ending]


async def test_a_deferred_frame_over_the_bound_is_written_at_once_after_the_waiting_ones(
    pki: Pki,
) -> None:
    recorder = Recorder()
    async with loopback_server(recorder.handle, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        writes = counting_writes(writer)
        conn = Connection(reader, writer, sender_id="node", heartbeat_interval=0)
        await conn.send(cancel("small"), defer=True)
        assert writes == []
        large = cancel("large-" + "x" * DEFER_AT_MOST)  # its frame is over the bound
        await conn.send(large, defer=True)
        # before send returned: the waiting frame, then the large one, in one write
        assert len(writes) == 1
        assert writes[0] > DEFER_AT_MOST
        await conn.close()
        await asyncio.wait_for(recorder.done.wait(), 5)
    assert recorder.run_ids == ["small", large.run_id]
