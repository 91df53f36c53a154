"""The public port's HTTP/1.1 front: the inference routes served here, every other
request handed to aiohttp's own protocol, on the same connection.

aiohttp's server costs about 0.4 ms of CPU per request on the edge's loop, most of a
request's own cost at load (the benchmark's profile); a protocol on the httptools
parser (llhttp, the parser of Node.js and of uvicorn) serves the same request for a
fraction of it. The inference routes (``HotRoutes``: OpenAI's chat, completions,
embeddings) are the traffic; the rest (models, runs, batches, files, Responses,
Messages, WebSockets, the console) stays on aiohttp, unchanged, so only what is
simple and hot is served here, through the same ``ApiGate`` and the same pipeline.

A connection starts here. For each request, once its head is parsed: a hot route
(``POST``, HTTP/1.1, no upgrade, no ``Expect``, and no ``Origin`` when CORS is on) is
served here; anything else, or a head llhttp refuses, makes the connection aiohttp's
from that request on: its protocol gets the connection and every byte from that
request's first one. Requests are answered in order: what a client pipelines after a
request waits, unparsed, until that request's answer is out. A client that leaves
cancels its request's task, and so its run (aiohttp's ``handler_cancellation``); a
head that does not arrive within ``header_timeout_s`` of the connection's start or its
previous answer closes it (aiohttp's ``keepalive_timeout``); the body's pace is the
gate's watchdog's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Final, cast

import httptools
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.tcp_helpers import tcp_keepalive
from loguru import logger
from multidict import CIMultiDict

from iop_edge.entrypoints.api_gate import ApiGate
from iop_edge.entrypoints.fast_exchange import FastRequest, FastStream, whole_answer
from iop_edge.entrypoints.inference_routes import SSE_HEADERS, HotRoute, HotRoutes
from iop_proto.service.logging import log_unexpected

MAX_HEAD_BYTES: Final = 64 * 1024
"""A head not complete within this many bytes goes to aiohttp, which refuses it (431)."""
MAX_PENDING_BYTES: Final = 256 * 1024
"""Bytes pipelined behind a request in progress before the connection stops being read."""
LINGER_S: Final = 2.0
"""A connection answered before its body ended is closed once the body ends, or this long
after the answer: closing with the body unread would reset it, and could lose the answer."""


class ApiFront:
    """The inference front of one API application: its hot routes, its gate, its limits."""

    def __init__(
        self,
        gate: ApiGate,
        hot: HotRoutes,
        *,
        max_body_bytes: int,
        header_timeout_s: float,
        cors: bool,
    ) -> None:
        self.gate = gate
        self.hot = {path.encode(): route for path, route in hot.items()}
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.cors = cors
        self._connections: set[_Connection] = set()

    def protocol_factory(
        self, fallback: Callable[[], asyncio.Protocol]
    ) -> Callable[[Callable[[], None]], asyncio.Protocol]:
        """Protocols for the public port (``CappedSite``'s ``ClosingFactory``): each calls
        its ``on_close`` once lost; ``fallback`` makes aiohttp's (``runner.server``)."""
        return functools.partial(_Connection, self, fallback)

    async def shutdown(self, timeout_s: float) -> None:
        """Close every connection: idle ones now, those answering once done (at most
        ``timeout_s``; then their requests are cancelled). aiohttp closes its own."""
        for connection in list(self._connections):
            connection.close_when_idle()
        tasks = [c.task for c in self._connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for connection in list(self._connections):
            if not connection.handed_over:
                connection.close()


class _Connection(asyncio.Protocol):
    """One client connection on the public port (see the module's docstring)."""

    def __init__(
        self,
        front: ApiFront,
        fallback: Callable[[], asyncio.Protocol],
        on_close: Callable[[], None],
    ) -> None:
        self._front = front
        self._fallback = fallback
        self._on_close = on_close  # the site's count of open connections
        self.transport: asyncio.Transport | None = None
        self._inner: asyncio.Protocol | None = None  # aiohttp's, once handed over
        self._parser: httptools.HttpRequestParser  # each request's own (``_next_request``)
        self._raw = bytearray()  # the request's bytes from its first one, until it is read
        self._url = b""
        self._head: list[tuple[bytes, bytes]] = []
        self._request: FastRequest | None = None
        self.task: asyncio.Task[None] | None = None
        self._pending = bytearray()  # pipelined behind the request in progress
        self._stop: str | None = None  # why a callback stopped the parser
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._closing = False  # ends with the request in progress
        self._broken = False  # its parser refused the body: nothing more is read
        self._idle_close = False
        self._remote: str | None = None  # the client's address (``connection_made``)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        tcp_keepalive(self.transport)
        # The client's address, for every request of the connection (a system call each
        # time it is asked of uvloop's transport).
        peer = transport.get_extra_info("peername")
        self._remote = peer[0] if isinstance(peer, tuple) else None
        self._front._connections.add(self)
        self._next_request()

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)
            return
        request = self._request
        if request is not None and request.complete:
            if self._closing:
                return  # the connection ends with its answer: nothing more is read
            self._pending += data  # answered in order: it waits for the answer in progress
            if len(self._pending) > MAX_PENDING_BYTES and self.transport is not None:
                self.transport.pause_reading()
                self._reading_paused = True
            return
        if self._closing:
            # the rest of a body answered already: read to its end (``on_message_complete``
            # closes), kept nowhere
            with contextlib.suppress(httptools.HttpParserError, httptools.HttpParserUpgrade):
                self._parser.feed_data(data)
            return
        self._raw += data  # kept until the request is read: aiohttp's if handed over
        self._stop = None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if self._stop is None:
                raise  # a bug in a callback
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._request is None:
                self._hand_over()  # aiohttp answers a head it refuses, in its own way
            else:
                self._request.fail(BadHttpMessage(str(exc)))
                self._closing = self._broken = True  # nothing more can be read
            return
        if self._stop == "hand over":
            self._hand_over()
        elif self._stop == "overrun":
            raw = bytes(self._raw)
            self._pending += raw[_message_end(raw) :]
            self._raw.clear()
        elif self._request is None:
            if len(self._raw) > MAX_HEAD_BYTES:
                self._hand_over()
        elif self._request.complete:
            self._raw.clear()

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        return None  # the transport closes, and a request in progress is cancelled

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()
        self.write_paused = True

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
        self.write_paused = False
        self._release_drain(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_close()  # the loop reports a connection's loss once
        self._front._connections.discard(self)
        self._cancel_timer()
        self._release_drain(ConnectionResetError("Connection lost"))
        if self._inner is not None:
            self._inner.connection_lost(exc)
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its run ends (aiohttp's handler_cancellation)
        self.transport = None

    async def drained(self) -> None:
        if not self.write_paused:
            return
        if self.transport is None:
            raise ConnectionResetError("Connection lost")
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drain)

    @property
    def handed_over(self) -> bool:
        """aiohttp's connection now (its runner closes it)."""
        return self._inner is not None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def close_when_idle(self) -> None:
        """Close now if no request is in progress, else after its answer."""
        if self._inner is None and self.task is None:
            self.close()
        self._idle_close = True

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._request is not None:
            # a request pipelined in the same bytes (its first byte is enough): it waits
            self._stop = "overrun"
            raise _Stop

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head.append((name, value))

    def on_headers_complete(self) -> None:
        front, parser = self._front, self._parser
        route = front.hot.get(self._url.partition(b"?")[0])
        if (
            route is None
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or parser.should_upgrade()
        ):
            self._stop = "hand over"
            raise _Stop
        # as str, every byte kept (surrogateescape), in the order the client sent them
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in self._head:
            headers.add(
                name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
            )
        if "Expect" in headers or (front.cors and "Origin" in headers):
            self._stop = "hand over"  # 100-continue, CORS marks: aiohttp's
            raise _Stop
        if self._timer is not None:
            self._timer.cancel()
        request = FastRequest(
            self,
            self._url.partition(b"?")[0].decode("ascii"),
            headers,
            remote=self._remote,
            keep_alive=parser.should_keep_alive(),
            max_bytes=front.max_body_bytes,
        )
        self._request = request
        self.task = asyncio.get_running_loop().create_task(self._serve(request, route))

    def on_body(self, body: bytes) -> None:
        request = self._request
        if request is None or self._closing:
            return
        # the request's body (``FastRequest.read``): kept up to its limit, past it counted
        request.total_bytes += len(body)
        if request.total_bytes <= request.max_bytes:
            request.chunks.append(body)
        else:
            request.chunks.clear()
            request.wake()  # ``read`` refuses it now, before the rest arrives

    def on_message_complete(self) -> None:
        request = self._request
        if request is not None:
            request.complete = True
            if request.waiter is not None:
                request.wake()
        if self._closing and self.task is None:
            self.close()  # answered already; the rest of its body has arrived

    # serving

    async def _serve(self, request: FastRequest, route: HotRoute) -> None:
        stream = FastStream(self, request, SSE_HEADERS)  # where the route's stream goes, if any
        try:
            handler = functools.partial(route, request, out=stream)
            answer = await self._front.gate.serve(request, handler)
            if answer is stream:
                keep_alive = stream.finished and stream.keep_alive
            else:
                keep_alive = request.keep_alive and request.complete
                self._write(whole_answer(cast(web.StreamResponse, answer), keep_alive))
        except asyncio.CancelledError:
            return  # the client left (the connection is lost): nothing to answer
        except Exception as exc:
            log_unexpected(exc, "the API front failed answering {}", request.path)
            keep_alive = False
        finally:
            self.task = None
        if keep_alive and not self._idle_close and self.transport is not None:
            self._next_request()
        else:
            self._close_after(request)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close_after(self, request: FastRequest) -> None:
        """The connection ends with this answer: now, or once the request's body ended."""
        self._closing = True
        if request.complete or self._broken or self.transport is None:
            self.close()
        else:
            self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def _next_request(self) -> None:
        """Wait for the next request's head (the connection's first, or the one after an
        answer): a parser of its own from its first byte, at most ``header_timeout_s``,
        reading resumed, and what was pipelined behind the last request read now."""
        self._request = None
        self._parser = httptools.HttpRequestParser(self)
        self._url, self._head = b"", []
        self._cancel_timer()
        timeout = self._front.header_timeout_s
        if timeout > 0:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._head_late)
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._pending:
            data, self._pending = bytes(self._pending), bytearray()
            self.data_received(data)  # read as if it arrived now: the next request

    def _hand_over(self) -> None:
        """Make the connection aiohttp's, from the first byte of the request being read."""
        self._cancel_timer()
        inner = self._fallback()
        self._inner = inner
        raw, self._raw = bytes(self._raw), bytearray()
        assert self.transport is not None  # bytes arrived on it just now
        inner.connection_made(self.transport)
        if self.write_paused:
            inner.pause_writing()
        if raw:
            inner.data_received(raw)

    def _head_late(self) -> None:
        if self._request is None and self._inner is None:
            logger.debug("closing an API connection: no request head within its timeout")
            self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release_drain(self, exc: Exception | None) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            if exc is None:
                drain.set_result(None)
            else:
                drain.set_exception(exc)
                drain.exception()  # retrieved: a writer may not be waiting


class _Stop(Exception):
    """Raised by a parser callback to stop the parser where it is (``_Connection._stop``)."""


def _message_end(raw: bytes) -> int:
    """Where the first request of ``raw`` (a request from its first byte, and what was
    pipelined after it) ends. llhttp does not say where in a buffer a message ended, and
    its framing (a chunked body's) is known to a parser only: the end is the shortest
    prefix of ``raw`` a fresh parser completes the request in, found by bisection. Only
    bytes pipelined behind a request in the same read come here."""
    low, high = 0, len(raw)  # raw[:high] completes it
    while low < high:
        middle = (low + high) // 2
        if _completes(raw[:middle]):
            high = middle
        else:
            low = middle + 1
    return high


class _Probe:
    __slots__ = ("complete",)

    def __init__(self) -> None:
        self.complete = False

    def on_message_complete(self) -> None:
        self.complete = True
        raise _Stop  # what follows is the next request's


def _completes(prefix: bytes) -> bool:
    probe = _Probe()
    # the callback's stop, or bytes the request did not need
    with contextlib.suppress(httptools.HttpParserError, httptools.HttpParserUpgrade):
        httptools.HttpRequestParser(probe).feed_data(prefix)
    return probe.complete
