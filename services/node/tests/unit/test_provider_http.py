"""The engines' HTTP client against scripted servers on 127.0.0.1 (plain and TLS).

Each server here writes exact bytes, so keep-alive, the three ways a body ends
(length, chunks, the connection's close), a connection the server drops while it
is pooled, the limit on open connections and dropping a connection whose answer
was not read are checked on real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import trustme

from iop_node.adapters.provider_http import (
    ProviderConnectError,
    ProviderConnectionLost,
    ProviderHttp,
)
from iop_proto.testing import refused_port

JSON = {"Content-Type": "application/json"}
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@dataclass
class Server:
    """Accepts connections and runs ``script`` on each; counts them and what is open."""

    script: Script
    url: str = ""
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    reader_done: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.script(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_client.set()  # the script wrote or read on: the client had left
        finally:
            self.open_now -= 1
            writer.close()


async def read_request(reader: asyncio.StreamReader, server: Server) -> bytes | None:
    """One request (head and ``Content-Length`` body), or None when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        server.closed_by_client.set()
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    request = head + await reader.readexactly(length)
    server.requests.append(request)
    server.got_request.set()
    return request


def answer(body: bytes, *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", "Content-Type: application/json; charset=utf-8", *extra]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def keep_alive(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    while await read_request(r, s) is not None:
        w.write(answer(b'{"ok": true}'))


@contextlib.asynccontextmanager
async def serve(script: Script, tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    server = Server(script)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=tls)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"{'https' if tls else 'http'}://localhost:{port}"
    async with listener:
        yield server


@pytest.fixture
async def client() -> AsyncIterator[ProviderHttp]:
    http = ProviderHttp()
    yield http
    await http.aclose()


async def post(http: ProviderHttp, url: str, body: bytes = b"{}") -> tuple[int, str, bytes]:
    response = await http.request("POST", url, headers=JSON, body=body, connect_timeout_s=5)
    async with response:
        return response.status, response.content_type, await response.read()


async def test_one_connection_carries_request_after_request(client: ProviderHttp) -> None:
    async with serve(keep_alive) as server:
        for _ in range(3):
            assert await post(client, server.url + "/v1/chat/completions") == (
                200,
                "application/json",
                b'{"ok": true}',
            )
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\nContent-Length: 2\r\n" in first
        assert b"\r\nContent-Type: application/json\r\n" in first
        assert first.endswith(b"\r\n\r\n{}")


async def test_each_request_carries_its_own_headers_length_and_body(client: ProviderHttp) -> None:
    """A request's head is kept per method, URL and headers: what changes between two
    requests (the headers, the body and its length, GET or POST) is what each sends."""
    async with serve(keep_alive) as server:
        url = server.url + "/v1/chat/completions"
        await post(client, url, b"{}")
        keyed = {**JSON, "Authorization": "Bearer k2"}
        response = await client.request(
            "POST", url, headers=keyed, body=b'{"a": 1}', connect_timeout_s=5
        )
        async with response:
            await response.read()
        response = await client.request(
            "GET", server.url + "/v1/models", headers={}, connect_timeout_s=5
        )
        async with response:
            await response.read()
        await post(client, url, b"[]")
        first, second, models, last = server.requests
        assert b"Authorization" not in first
        assert first.endswith(b"\r\n\r\n{}")
        assert b"\r\nAuthorization: Bearer k2\r\n" in second
        assert b"\r\nContent-Length: 8\r\n" in second
        assert second.endswith(b'\r\n\r\n{"a": 1}')
        assert models.startswith(b"GET /v1/models HTTP/1.1\r\n")
        assert b"Content-Length" not in models
        assert models.endswith(b"\r\n\r\n")
        assert b"Authorization" not in last
        assert last.endswith(b"\r\n\r\n[]")
        assert b"\r\nUser-Agent: iop-node\r\n" in last


async def test_chunked_and_close_delimited_bodies_are_read_whole(client: ProviderHttp) -> None:
    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        while await read_request(r, s) is not None:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in (b"4\r\nabcd\r\n", b"3\r\nef", b"g\r\n", b"0\r\n\r\n"):
                w.write(piece)
                await w.drain()
                await asyncio.sleep(0.01)

    async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await w.drain()

    async with serve(chunked) as server:
        assert (await post(client, server.url))[2] == b"abcdefg"
        assert (await post(client, server.url))[2] == b"abcdefg"
        assert server.connections == 1  # chunked ends on its own: the connection is reused
    async with serve(until_close) as server:
        assert (await post(client, server.url))[2] == b"all of it"
        assert (await post(client, server.url))[2] == b"all of it"
        assert server.connections == 2  # ended by the close: never reused


async def test_a_connection_the_server_dropped_while_pooled_is_not_used(
    client: ProviderHttp,
) -> None:
    async def one_each(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(answer(b"{}"))  # keep-alive promised, then the connection dropped
        await w.drain()

    async with serve(one_each) as server:
        for _ in range(3):
            assert (await post(client, server.url))[0] == 200
        assert server.connections == 3
        assert len(server.requests) == 3  # each request sent once, on a live connection


async def test_open_connections_stay_within_the_limit() -> None:
    release = asyncio.Event()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        while await read_request(r, s) is not None:
            await release.wait()
            w.write(answer(b"{}"))

    http = ProviderHttp(limit=2)
    try:
        async with serve(slow) as server:
            calls = [asyncio.create_task(post(http, server.url)) for _ in range(5)]
            async with asyncio.timeout(10):
                while len(server.requests) < 2:
                    server.got_request.clear()
                    await server.got_request.wait()
            assert server.most_open == 2
            release.set()
            assert [status for status, _, _ in await asyncio.gather(*calls)] == [200] * 5
            assert server.most_open == 2
            assert server.connections == 2
    finally:
        await http.aclose()


async def test_an_answer_not_read_to_its_end_drops_the_connection(client: ProviderHttp) -> None:
    async def endless(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # an engine generating: the client leaving is what stops it
            w.write(b"2\r\nxx\r\n")
            await w.drain()
            await asyncio.sleep(0.01)

    async with serve(endless) as server:
        response = await client.request(
            "POST", server.url, headers=JSON, body=b"{}", connect_timeout_s=5
        )
        async for chunk in response.iter_any():
            assert chunk.startswith(b"xx")
            break
        response.release()  # not at its end: closed, not pooled
        async with asyncio.timeout(10):
            await server.closed_by_client.wait()


async def test_cancelling_while_waiting_for_the_answer_closes_the_connection(
    client: ProviderHttp,
) -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        await read_request(r, s)  # returns None once the client closed

    async with serve(silent) as server:
        call = asyncio.create_task(post(client, server.url))
        async with asyncio.timeout(10):
            await server.got_request.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        async with asyncio.timeout(10):
            await server.closed_by_client.wait()


async def test_failures_are_typed(client: ProviderHttp) -> None:
    with refused_port() as port:
        with pytest.raises(ProviderConnectError):
            await post(client, f"http://127.0.0.1:{port}/v1/models")

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"SMTP ready\r\n\r\n")
        await w.drain()

    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await w.drain()

    async with serve(garbage) as server:
        with pytest.raises(ProviderConnectionLost, match="not a valid HTTP response"):
            await post(client, server.url)
    async with serve(cut) as server:
        with pytest.raises(ProviderConnectionLost):
            await post(client, server.url)


async def test_https_checks_the_engine_certificate() -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_tls)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    trusted, stranger = ProviderHttp(tls=trusting), ProviderHttp()
    try:
        async with serve(keep_alive, server_tls) as server:
            assert await post(trusted, server.url) == (200, "application/json", b'{"ok": true}')
            with pytest.raises(ProviderConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await post(stranger, server.url)
    finally:
        await trusted.aclose()
        await stranger.aclose()


async def test_a_header_with_a_line_break_is_refused(client: ProviderHttp) -> None:
    async with serve(keep_alive) as server:
        with pytest.raises(ValueError, match="line break"):
            await client.request(
                "GET",
                server.url,
                headers={"Authorization": "Bearer x\r\nX-Evil: 1"},
                connect_timeout_s=5,
            )
        assert server.requests == []


async def test_a_connection_the_engine_talks_on_unasked_is_dropped(client: ProviderHttp) -> None:
    async def chatty(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(answer(b"{}"))
        await w.drain()
        # Most likely read on its own; in the answer's read it is refused the same way.
        await asyncio.sleep(0.05)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")  # nothing asked for it
        await w.drain()
        await read_request(r, s)  # None once the client dropped the connection
        if len(s.requests) < 2:
            s.closed_by_client.set()

    async with serve(chatty) as server:
        assert (await post(client, server.url))[0] == 200
        async with asyncio.timeout(10):
            await server.closed_by_client.wait()
        assert (await post(client, server.url))[0] == 200  # on a new connection
        assert server.connections == 2


async def test_a_stream_left_before_its_last_chunk_keeps_its_connection(
    client: ProviderHttp,
) -> None:
    async def sse(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        while await read_request(r, s) is not None:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            w.write(b"Transfer-Encoding: chunked\r\n\r\n")
            w.write(b"e\r\ndata: [DONE]\n\n\r\n")
            await w.drain()
            await s.reader_done.wait()  # the end of the body only once the reader left
            s.reader_done.clear()
            w.write(b"0\r\n\r\n")

    async with serve(sse) as server:
        for _ in range(2):
            response = await client.request(
                "POST", server.url, headers=JSON, body=b"{}", connect_timeout_s=5
            )
            async for chunk in response.iter_any():
                assert chunk == b"data: [DONE]\n\n"
                break  # as the SSE reader stops at [DONE]
            response.release()
            server.reader_done.set()
            await pooled(client)
        assert server.connections == 1


async def pooled(client: ProviderHttp, within: float = 10.0) -> None:
    """Until a connection is back in the pool (its answer ended after the reader left)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while client.idle_connections == 0:
        assert loop.time() - started < within, "the connection was not pooled"
        await asyncio.sleep(0.01)


async def test_a_body_larger_than_the_read_ahead_is_read_whole(client: ProviderHttp) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: reading pauses and resumes on the way

    async def large(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        while await read_request(r, s) is not None:
            w.write(answer(body))
            await w.drain()

    async with serve(large) as server:
        for _ in range(2):
            response = await client.request("GET", server.url, headers={}, connect_timeout_s=5)
            received = bytearray()
            async with response:
                async for chunk in response.iter_any():
                    received += chunk
                    await asyncio.sleep(0)  # a reader slower than the socket
            assert received == body
        assert server.connections == 1
