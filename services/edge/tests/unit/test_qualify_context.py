"""``iopctl qualify``'s context search (cli/qualify_suite.py) against a small HTTP server
that plays an engine with a fixed context: doubling, then bisection, to within the last
step's sixteenth; the declared window as a ceiling; every request pinned."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from iop_edge.cli.edge_client import EdgeClient
from iop_edge.cli.qualify_suite import PinnedClient, SuiteOptions, context_reached


@dataclass
class Engine:
    """Accepts a prompt of at most ``limit`` words; counts a token per word."""

    limit: int
    asked: list[int] = field(default_factory=list)
    pins: set[str] = field(default_factory=set)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        words = body["messages"][0]["content"].count("word")
        self.asked.append(words)
        self.pins.add(request.headers.get("x-iop-provider", ""))
        if words > self.limit:
            error = {"message": "too long", "code": "context_length_exceeded"}
            return web.json_response({"error": error}, status=400)
        return web.json_response({"choices": [], "usage": {"prompt_tokens": words}})


@pytest.fixture
async def serve() -> AsyncIterator[tuple[Engine, str]]:
    engine = Engine(limit=3000)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield engine, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def reach(url: str, declared: int) -> dict[str, object]:
    async with aiohttp.ClientSession() as session:
        pinned = PinnedClient(EdgeClient(session, url, "k"), "n/p", SuiteOptions())
        return await context_reached(pinned, "m", declared, SuiteOptions())


async def test_doubling_then_bisection_finds_the_limit(serve: tuple[Engine, str]) -> None:
    engine, url = serve
    found = await reach(url, declared=0)
    assert engine.asked[:5] == [256, 512, 1024, 2048, 4096]  # refused at 4096
    assert engine.asked[5:] == [3072, 2560, 2816, 2944]  # then halving the gap
    assert found == {
        "declared": None,
        "reached_tokens": 2944,
        "refused_at_words": 3072,
        "stopped": "context overflow",
    }
    assert engine.pins == {"n/p"}


async def test_the_declared_window_is_the_ceiling(serve: tuple[Engine, str]) -> None:
    engine, url = serve
    found = await reach(url, declared=2048)
    assert engine.asked == [256, 512, 1024, 1984]
    assert found["stopped"] == "declared context window"
    assert found["reached_tokens"] == 1984
