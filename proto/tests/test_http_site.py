"""The capped HTTP site: at most ``max_connections`` held, the rest wait in the backlog and are
served when one closes; the admin port closes idle connections."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry

from iop_proto.service import AdminServer
from iop_proto.service.http_site import REFUSALS_PER_CONNECTION, CappedSite

WAIT = 10.0  # an upper bound on waiting for an explicit signal, never a sleep
REQUEST = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"


@contextlib.asynccontextmanager
async def capped(max_connections: int, linger_s: float = 2.0) -> AsyncIterator[CappedSite]:
    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = CappedSite(
        runner, "127.0.0.1", 0, max_connections=max_connections, refusal_linger_s=linger_s
    )
    await site.start()
    try:
        yield site
    finally:
        await runner.cleanup()


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One request on a kept-alive connection; its status line."""
    writer.write(REQUEST)
    status = await reader.readline()
    while await reader.readline() not in (b"\r\n", b""):
        pass
    await reader.readexactly(4)  # "pong"
    return status


async def test_over_the_cap_a_connection_gets_a_503_and_a_clean_close() -> None:
    await over_the_cap()


def test_the_same_on_uvloop() -> None:
    """The services run on uvloop, whose transports are not asyncio's classes."""
    uvloop.run(over_the_cap())


async def over_the_cap() -> None:
    async with capped(2) as site:
        held = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(2)]
        for reader, writer in held:
            assert (await ask(reader, writer)).startswith(b"HTTP/1.1 200")
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(REQUEST)
        async with asyncio.timeout(WAIT):
            answer = await reader.read()  # to the server's FIN: no reset lost the answer
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"Retry-After: 1\r\n" in answer
        assert b"Connection: close\r\n" in answer
        assert site.open_connections == 2
        assert site.refused == 1
        writer.close()
        for _, other in held:
            other.close()


async def test_with_refusals_at_the_cap_too_a_connection_waits_until_one_closes() -> None:
    async with capped(1, linger_s=WAIT * 3) as site:  # the silent refusal stays
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        assert (await ask(reader, writer)).startswith(b"HTTP/1.1 200")
        # clients over the cap that send nothing: their refusals linger, holding those slots
        silent = []
        for _ in range(REFUSALS_PER_CONNECTION):
            silent.append((await asyncio.open_connection("127.0.0.1", site.port))[1])
        async with asyncio.timeout(WAIT):
            while site.refusing < REFUSALS_PER_CONNECTION:  # noqa: ASYNC110 - the server's accept
                await asyncio.sleep(0.01)
        # the kernel completes the next handshake (backlog); the site does not accept it yet
        later_reader, later_writer = await asyncio.open_connection("127.0.0.1", site.port)
        waiting = asyncio.create_task(ask(later_reader, later_writer))
        done, _ = await asyncio.wait({waiting}, timeout=0.3)
        assert not done, "accepted beyond both caps"
        writer.close()  # a slot for a request frees up: the waiting one is served
        async with asyncio.timeout(WAIT):
            assert (await waiting).startswith(b"HTTP/1.1 200")
        later_writer.close()
        for refused in silent:
            refused.close()


async def test_every_closed_connection_frees_its_slot() -> None:
    async with capped(3) as site:
        for _ in range(10):  # more than the cap, one after another: a leaked slot would hang
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            async with asyncio.timeout(WAIT):
                assert (await ask(reader, writer)).startswith(b"HTTP/1.1 200")
            writer.close()
            await writer.wait_closed()


async def test_a_stopped_site_accepts_nothing() -> None:
    async with capped(4) as site:
        port = site.port
        await site.stop()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)


def test_the_cap_must_allow_a_connection() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        CappedSite(_NoRunner(), "127.0.0.1", 0, max_connections=0)  # type: ignore[arg-type]


class _NoRunner:
    server = object()


async def test_the_admin_port_closes_an_idle_connection() -> None:
    admin = AdminServer("svc", CollectorRegistry(), host="127.0.0.1", port=0, idle_timeout_s=0.2)
    port = await admin.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(WAIT):
            # kept alive after its answer, then idle: the server closes it (read() ends)
            answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        await admin.close()
