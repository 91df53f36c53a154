"""A dead peer is let go at once: keepalive on every socket, and a heartbeat verdict that
does not wait for the TLS teardown a silent peer never completes."""

from __future__ import annotations

import asyncio
import socket
import sys

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed, HeartbeatTimeout, ProtocolError
from iop_proto.keepalive import USER_TIMEOUT_MS
from iop_proto.testing import Pki, loopback_server, open_client


async def test_both_ends_of_a_connection_carry_tcp_keepalive(pki: Pki) -> None:
    accepted: list[Connection] = []
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(Connection(reader, writer, sender_id="edge", heartbeat_interval=0))
        await release.wait()
        await accepted[0].close()

    async with loopback_server(handler, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        dialed = Connection(reader, writer, sender_id="node", heartbeat_interval=0)
        while not accepted:  # noqa: ASYNC110 - the handler runs on this loop, next pass
            await asyncio.sleep(0)
        for sock in (writer.get_extra_info("socket"), accepted[0]._writer.get_extra_info("socket")):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if sys.platform == "linux":
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == (
                    USER_TIMEOUT_MS
                )
        release.set()
        await dialed.close()


async def test_a_peer_that_stops_reading_is_let_go_without_its_close_notify(pki: Pki) -> None:
    """The peer's process is frozen: its kernel still takes our bytes, it answers nothing
    (not the TLS close_notify either, which asyncio would wait 30 s for)."""
    interval = 0.05
    outcome: list[BaseException] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=interval) as c:
            try:
                await c.receive()
            except (ProtocolError, ConnectionClosed) as exc:
                outcome.append(exc)

    async with loopback_server(handler, pki.server()) as port:
        _reader, writer = await open_client(port, pki.client())
        writer.transport.pause_reading()  # "frozen": nothing read, nothing answered
        async with asyncio.timeout(5):  # far below asyncio's 30 s TLS shutdown wait
            while not outcome:  # noqa: ASYNC110 - the handler's verdict, on this loop
                await asyncio.sleep(interval)
        writer.transport.abort()
    assert isinstance(outcome[0], HeartbeatTimeout)
