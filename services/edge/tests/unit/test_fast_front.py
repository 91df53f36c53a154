"""The public port's HTTP/1.1 front (``fast_front``) on real TCP: its hot routes served by
itself, everything else by aiohttp on the same connection, in order; chunked bodies, the
body limit, a client leaving, the header timeout, the stop gate, a head llhttp refuses.

The routes here are small stand-ins with the pipeline's signature (``HotRoute``); the
API's own routes run through the front in ``test_http_api`` (every test there twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from iop_edge.entrypoints.api_gate import ApiGate
from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.entrypoints.fast_front import ApiFront
from iop_edge.entrypoints.inference_routes import HotRoutes, StreamOut
from iop_edge.entrypoints.stop_gate import StopGate
from iop_proto.service.http_site import CappedSite

HEADER_TIMEOUT_S = 0.5


class OpenKeys:
    configured = True  # a fleet config has arrived
    open = True

    def lookup(self, presented_key: str) -> None:
        return None


@dataclass
class Served:
    port: int
    gate: StopGate
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


async def echo(request: ApiRequest, *, out: StreamOut) -> web.StreamResponse:
    """The body read, answered whole: its length and its JSON."""
    body = await request.read()
    payload = {"path": request.path, "length": len(body), "body": json.loads(body)}
    return web.json_response(payload, headers={"X-Request-Id": "r1"})


async def stream(request: ApiRequest, *, out: StreamOut) -> StreamOut:
    """Three SSE events, each its own chunk."""
    await request.read()
    await out.prepare(request)
    for n in range(3):
        await out.write(b"data: %d\n\n" % n)
    await out.write_eof()
    return out


@contextlib.asynccontextmanager
async def serve(max_body_bytes: int = 1024) -> AsyncIterator[Served]:
    gate = StopGate()
    served = Served(0, gate)

    async def wait_forever(request: ApiRequest, *, out: StreamOut) -> web.StreamResponse:
        served.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            served.cancelled.set()
            raise
        raise AssertionError("unreachable")

    hot: HotRoutes = {"/v1/echo": echo, "/v1/stream": stream, "/v1/wait": wait_forever}
    api_gate = ApiGate(OpenKeys(), allow_open=True, stop_gate=gate)
    front = ApiFront(
        api_gate,
        hot,
        max_body_bytes=max_body_bytes,
        header_timeout_s=HEADER_TIMEOUT_S,
        cors=False,
    )
    app = web.Application(middlewares=[api_gate.middleware()])

    async def other(request: web.Request) -> web.Response:
        return web.json_response({"served_by": "aiohttp", "body": (await request.read()).decode()})

    app.router.add_route("*", "/v1/other", other)
    app.router.add_post("/v1/echo", other)  # what the front hands over lands here
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = CappedSite(
        runner, "127.0.0.1", 0, max_connections=100, protocol_factory=front.protocol_factory
    )
    await site.start()
    served.port = site.port
    try:
        yield served
    finally:
        await site.stop()
        await front.shutdown(1.0)
        await runner.cleanup()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    status_line = await asyncio.wait_for(reader.readline(), 10)
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        assert headers.get("transfer-encoding") == "chunked", headers
        parts = []
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            parts.append(await reader.readexactly(size))
            await reader.readline()
        body = b"".join(parts)
    return Answer(int(status_line.split()[1]), headers, body)


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % (path.encode(), len(body))
    return head + b"".join(extra) + b"\r\n" + body


def chunked(path: str, *parts: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode()
    return head + b"".join(b"%x;ext=1\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_pipelined_requests_are_answered_in_order_by_whichever_serves_each() -> None:
    async with serve() as served, connect(served.port) as (reader, writer):
        writer.write(
            post("/v1/echo", b'{"n": 1}')
            + chunked("/v1/echo", b'{"n"', b": 2}")
            + b"GET /v1/other HTTP/1.1\r\nHost: x\r\n\r\n"
            + post("/v1/other", b"three")
        )
        first, second = await read_answer(reader), await read_answer(reader)
        third, fourth = await read_answer(reader), await read_answer(reader)
    assert first.status == 200
    assert json.loads(first.body)["body"] == {"n": 1}
    assert first.headers["x-request-id"] == "r1"
    assert json.loads(second.body) == {"path": "/v1/echo", "length": 8, "body": {"n": 2}}
    assert json.loads(third.body) == {"served_by": "aiohttp", "body": ""}
    assert json.loads(fourth.body) == {"served_by": "aiohttp", "body": "three"}


async def test_a_keep_alive_connection_goes_on_after_each_answer() -> None:
    async with serve() as served, connect(served.port) as (reader, writer):
        for n in range(3):
            writer.write(post("/v1/echo", b'{"n": %d}' % n))
            assert json.loads((await read_answer(reader)).body)["body"] == {"n": n}
        writer.write(post("/v1/stream", b"{}"))
        streamed = await read_answer(reader)
        writer.write(post("/v1/echo", b'{"n": 9}'))
        assert json.loads((await read_answer(reader)).body)["body"] == {"n": 9}
    assert streamed.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert streamed.headers["content-type"] == "text/event-stream"


async def test_a_head_split_anywhere_is_read_whole() -> None:
    request = post("/v1/echo", b'{"split": true}')
    async with serve() as served, connect(served.port) as (reader, writer):
        for offset in range(len(request)):
            writer.write(request[offset : offset + 1])
            await writer.drain()
        answer = await read_answer(reader)
    assert json.loads(answer.body)["body"] == {"split": True}


async def test_a_body_past_the_limit_is_413_and_the_connection_closes() -> None:
    async with serve(max_body_bytes=100) as served, connect(served.port) as (reader, writer):
        whole = post("/v1/echo", b'{"x": "%b"}' % (b"a" * 10_000))
        writer.write(whole[:500])  # past the limit, far from the end: answered now
        answer = await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert answer.status == 413
    assert answer.headers["connection"] == "close"
    assert "Maximum request body size 100 exceeded" in json.loads(answer.body)["error"]["message"]


async def test_a_client_that_leaves_cancels_its_request() -> None:
    async with serve() as served:
        async with connect(served.port) as (_, writer):
            writer.write(post("/v1/wait", b"{}"))
            await asyncio.wait_for(served.started.wait(), 10)
        await asyncio.wait_for(served.cancelled.wait(), 10)


async def test_a_head_that_does_not_arrive_in_time_closes_the_connection() -> None:
    async with serve() as served, connect(served.port) as (reader, writer):
        writer.write(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\n")
        assert await asyncio.wait_for(reader.read(), HEADER_TIMEOUT_S + 10) == b""


async def test_a_closed_stop_gate_answers_503_and_closes() -> None:
    async with serve() as served, connect(served.port) as (reader, writer):
        served.gate.close()
        writer.write(post("/v1/echo", b"{}"))
        answer = await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert answer.status == 503
    assert answer.headers["connection"] == "close"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/echo HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=["two_lengths", "expect", "http_1_0"],
)
async def test_what_the_front_does_not_serve_is_aiohttps(request_bytes: bytes) -> None:
    async with serve() as served, connect(served.port) as (reader, writer):
        writer.write(request_bytes.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"))
        answer = await asyncio.wait_for(reader.read(), 10)
    if b"Content-Length: 3" in request_bytes:
        assert answer.startswith((b"HTTP/1.0 400 ", b"HTTP/1.1 400 "))  # aiohttp's refusal
        assert b"Duplicate Content-Length" in answer
    else:
        assert b" 200 OK\r\n" in answer  # after a 100 Continue for the Expect
        assert b'"served_by": "aiohttp"' in answer


async def test_a_stream_writes_each_event_as_a_chunk() -> None:
    """The stream's own framing: a chunk per write, the last chunk at the end."""
    async with serve() as served, connect(served.port) as (reader, writer):
        writer.write(post("/v1/stream", b"{}"))
        raw = b""
        while not raw.endswith(b"0\r\n\r\n"):
            raw += await asyncio.wait_for(reader.read(4096), 10)
    assert (
        raw.split(b"\r\n\r\n", 1)[1]
        == b"".join(b"9\r\ndata: %d\n\n\r\n" % n for n in range(3)) + b"0\r\n\r\n"
    )


async def test_a_body_the_parser_refuses_is_400_and_the_connection_closes() -> None:
    async with serve() as served, connect(served.port) as (reader, writer):
        head = b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        writer.write(head + b"2\r\n{}\r\nzz\r\n")
        answer = await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert answer.status == 400
    assert answer.headers["connection"] == "close"
    assert "could not be read" in json.loads(answer.body)["error"]["message"]


async def test_a_request_whose_first_bytes_follow_another_in_one_read_is_read_whole() -> None:
    second = post("/v1/echo", b'{"n": 2}')
    async with serve() as served, connect(served.port) as (reader, writer):
        writer.write(post("/v1/echo", b'{"n": 1}') + second[:2])
        first = await read_answer(reader)
        writer.write(second[2:])
        answer = await read_answer(reader)
    assert json.loads(first.body)["body"] == {"n": 1}
    assert json.loads(answer.body)["body"] == {"n": 2}
