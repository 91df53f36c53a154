"""StreamServer: the handshake is the server's, every refusal has a reason, no hello is lost.

Each case runs on asyncio's loop and on uvloop (the services' default): uvloop
reads an accepted socket before any handler runs, which is what lost the
ClientHello when connections were accepted as plain TCP and upgraded later.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from iop_proto.accept import StreamServer
from iop_proto.testing import Pki, open_client
from iop_proto.tls import TlsRefused

uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (Windows has none)")

Runner = Callable[[Coroutine[Any, Any, None]], None]
LOOPS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Runner:
    return LOOPS[request.param]


class Echo:
    """A handler that yields before it reads (where the lost hello used to show) and echoes."""

    def __init__(self) -> None:
        self.refusals: list[tuple[str, object]] = []
        self.served = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.01)
        self.served += 1
        line = await reader.readline()
        writer.write(line)
        await writer.drain()
        writer.close()

    def refused(self, exc: TlsRefused, peer: object) -> None:
        self.refusals.append((exc.reason, peer))


def test_tls_clients_are_served_after_a_slow_handler_start(pki: Pki, run: Runner) -> None:
    async def scenario() -> None:
        echo = Echo()
        server = StreamServer(echo.handle, pki.server(), echo.refused, handshake_timeout_s=2)
        port = await server.start("127.0.0.1", 0)
        try:
            for n in range(5):
                reader, writer = await asyncio.wait_for(open_client(port, pki.client()), 5)
                writer.write(b"hello %d\n" % n)
                assert await asyncio.wait_for(reader.readline(), 5) == b"hello %d\n" % n
                assert writer.get_extra_info("ssl_object") is not None
                await closed(writer)
        finally:
            server.close()
            await server.wait_closed()
        assert (echo.served, echo.refusals) == (5, [])

    run(scenario())


async def closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ssl.SSLError, ConnectionError):
        await writer.wait_closed()


@pytest.mark.parametrize(
    ("client", "reason"),
    [
        ("plaintext", "not_tls"),
        ("silent", "handshake_timeout"),
        ("no_certificate", "no_certificate"),
    ],
)
def test_each_refusal_reaches_the_owner_with_its_reason(
    pki: Pki, run: Runner, client: str, reason: str
) -> None:
    async def scenario() -> None:
        echo = Echo()
        server = StreamServer(echo.handle, pki.server(), echo.refused, handshake_timeout_s=0.5)
        port = await server.start("127.0.0.1", 0)
        writer: asyncio.StreamWriter | None = None
        try:
            if client == "no_certificate":
                context = ssl.create_default_context(cafile=str(pki.edge.ca_file))
                context.check_hostname = False
                with contextlib.suppress(ssl.SSLError, ConnectionError):
                    _, writer = await open_client(port, context)
                    writer.write(b"x\n")
                    await writer.drain()
            else:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                if client == "plaintext":
                    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(300):
                if echo.refusals:
                    break
                await asyncio.sleep(0.01)
        finally:
            if writer is not None:
                await closed(writer)
            server.close()
            await server.wait_closed()
        assert echo.served == 0
        assert len(echo.refusals) == 1
        got, peer = echo.refusals[0]
        assert got == reason
        assert isinstance(peer, tuple)
        assert peer[0] == "127.0.0.1"

    run(scenario())


def test_close_ends_handshakes_in_progress_but_not_served_connections(
    pki: Pki, run: Runner
) -> None:
    async def scenario() -> None:
        held: list[asyncio.StreamWriter] = []

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)
            writer.write(await reader.readline())

        server = StreamServer(hold, pki.server(), Echo().refused, handshake_timeout_s=30)
        port = await server.start("127.0.0.1", 0)
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)  # no hello
        reader, writer = await open_client(port, pki.client())
        try:
            await asyncio.sleep(0.05)
            server.close()
            await asyncio.wait_for(server.wait_closed(), 5)
            # the served connection still works; the one still in its handshake was dropped
            writer.write(b"still here\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"still here\n"
            assert await asyncio.wait_for(silent_reader.read(), 5) == b""
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", port)
        finally:
            for each in (writer, silent, *held):
                await closed(each)

    run(scenario())
