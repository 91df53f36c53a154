"""tools/tcp_balancer.py as a process in front of real HTTP servers on loopback: round
robin, a dead backend skipped for the live one, a backend's death cuts only what it
carried, and SIGTERM ends it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

BALANCER = Path(__file__).resolve().parent / "tcp_balancer.py"


@contextlib.asynccontextmanager
async def backend(name: str, release: asyncio.Event | None = None) -> AsyncIterator[int]:
    """An HTTP server answering its name; ``/slow`` answers once ``release`` is set."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=name)

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"started ")
        assert release is not None
        await release.wait()
        await response.write(name.encode())
        return response

    app = web.Application()
    app.router.add_get("/", hello)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def balancer(*ports: int) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    args = [arg for port in ports for arg in ("--backend", f"127.0.0.1:{port}")]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(BALANCER),
        *("--listen", "127.0.0.1:0", "--rest", "30", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(30):
            while line := (await process.stdout.readline()).decode():
                if line.startswith("ready: balancer "):
                    break
        yield process, line.split()[-1]
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def names(url: str, count: int) -> list[str]:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        seen = []
        for _ in range(count):
            async with http.get(url) as response:
                seen.append(await response.text())
        return seen


async def test_connections_alternate_and_a_dead_backend_is_skipped() -> None:
    async with backend("gone") as dead:
        pass  # closed: its port now refuses connections
    async with backend("a") as a, backend("b") as b, balancer(a, b) as (process, url):
        assert sorted(await names(url, 4)) == ["a", "a", "b", "b"]
    async with backend("a") as a, balancer(dead, a) as (process, url):
        assert await names(url, 4) == ["a"] * 4  # the refused one is never a client's answer
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stdout is not None
        output = (await process.stdout.read()).decode()
        assert "Traceback" not in output
        assert f"backend 127.0.0.1:{dead} failed" in output


async def test_a_backend_that_dies_cuts_only_the_connection_it_carried() -> None:
    release = asyncio.Event()
    async with backend("a") as a:
        context = backend("b", release)
        b = await context.__aenter__()
        async with balancer(b, a) as (_, url):
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/slow") as response:
                    assert await response.content.readexactly(8) == b"started "
                    await context.__aexit__(None, None, None)  # b goes away mid-answer
                    with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
                        await response.read()
            assert await names(url, 3) == ["a"] * 3
