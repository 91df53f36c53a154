"""One connection to an engine: its request, its answer parsed by llhttp, read as it comes.

``Exchange`` is the asyncio protocol of one keep-alive connection, one request
at a time; httptools (llhttp, Node.js's parser; uvicorn's too) cuts the status
line, the headers and the body (``Content-Length``, chunked, or until the
connection closes) out of what arrives. ``ProviderResponse`` is what a caller
reads. ``provider_http`` pools the connections.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Final, Protocol

import httptools

MAX_HEADER_BYTES: Final = 64 * 1024
"""A response whose status line and headers pass this is refused: no engine sends that."""
HIGH_WATER: Final = 256 * 1024
"""Body bytes read ahead of the caller at most before the socket stops being read."""
FINISH_S: Final = 1.0
FINISH_BYTES: Final = 64 * 1024
"""A response released before its end (an SSE stream left at ``[DONE]``, its last chunk
still on the way) is read to its end for this long and this many bytes at most, and its
connection pooled then; past either it is closed."""


class ProviderHttpError(Exception):
    """An HTTP exchange with an engine failed."""


class ProviderConnectError(ProviderHttpError, ConnectionError):
    """No connection: refused, unresolvable, TLS refused, or the connect timed out."""


class ProviderConnectionLost(ProviderHttpError, ConnectionError):
    """The connection broke, or what came back is not HTTP."""


class Keeper(Protocol):
    """Where a connection goes when its answer is done with (``provider_http``'s pool)."""

    def put_back(self, exchange: Exchange) -> None:
        """The caller is done: pool the connection if it can carry another request."""

    def forget(self, exchange: Exchange) -> None:
        """The connection is closed (or closing)."""


class Exchange(asyncio.Protocol):
    """One connection to an engine; one request and its response at a time."""

    # The state of the answer to the request out: these values until the first request,
    # set anew by ``send`` for each.
    status: int = 0
    content_type: str = ""
    content_length: int | None = None
    received: int = 0  # bytes of this response so far (headers included)
    headers_done: bool = False
    keep_alive: bool = False  # read at the headers: llhttp forgets it after the body
    complete: bool = False
    failure: BaseException | None = None
    buffered: int = 0  # body bytes parsed and not yet taken by the reader
    paused: bool = False

    def __init__(self, pool: Keeper, origin: str) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        # What the reader waits on: resolved once a read from the socket was parsed
        # (or the connection failed), whatever it brought.
        self.waiter: asyncio.Future[None] | None = None
        self.pending = False  # a request is out and its answer not complete
        self._finishing: asyncio.TimerHandle | None = None  # released before its end
        # The body's chunks parsed and not yet read; empty whenever a request goes out (an
        # answer is pooled only once read to its end, and ``release`` drops the rest).
        self.body: collections.deque[bytes] = collections.deque()

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        if not self.pending:  # nothing asked: a server out of step with its connection
            self._fail(ProviderConnectionLost("data from the engine while no request was out"))
            return
        self.received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProviderConnectionLost(f"not a valid HTTP response: {exc}"))
            return
        if not self.headers_done and self.received > MAX_HEADER_BYTES:
            self._fail(ProviderConnectionLost(f"headers over {MAX_HEADER_BYTES} bytes"))
            return
        # The reader is woken once per read, after the parser took all of it: it finds
        # the headers, the body's chunks and the end together, however many there were.
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None
        self.pool.forget(self)
        if self.headers_done and not self.complete and self._close_delimited():
            self.complete = True  # a body without length or chunks ends with the connection
        elif not self.complete and self.failure is None:
            why = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
            self.failure = ProviderConnectionLost(why)
        self._wake()

    def pause_writing(self) -> None:  # a request body larger than the socket's buffers
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        # Only what a reader of the answer needs; llhttp has checked the syntax.
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif lowered == b"content-length" and value.strip().isdigit():
            self.content_length = int(value)

    def on_headers_complete(self) -> None:
        if not self.pending:  # a second answer in the read that completed the first
            self._fail(ProviderConnectionLost("an answer from the engine nobody asked for"))
            return
        self.status = self._parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer (none is asked for): skip it
            self.content_type, self.content_length = "", None
            return
        self.headers_done = True
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if not self.pending:
            return
        if self._finishing is not None:  # nobody reads it: counted, dropped
            self.buffered += len(body)
            if self.buffered > FINISH_BYTES:
                self.close()
            return
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.headers_done and self.pending:
            self.complete = True
            self.pending = False
            if self._finishing is not None:
                self._finishing.cancel()
                self._finishing = None
                self.pool.put_back(self)

    # -- the client's side

    def resume(self) -> None:
        """The reader caught up: read the socket again."""
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()

    def send(self, request: bytes) -> None:
        """Send ``request``, its answer's state started afresh."""
        assert self.transport is not None
        self.status = 0
        self.content_type = ""
        self.content_length = None
        self.received = 0
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.failure = None
        self.buffered = 0
        self.paused = False
        self.pending = True
        self.transport.write(request)

    def close(self) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None
        if self.transport is not None:
            self.transport.close()

    def release(self) -> None:
        """The caller is done: pooled now if the answer is complete, else once it is
        (``FINISH_S``, ``FINISH_BYTES``), else closed."""
        if self.complete or self.failure is not None or not self.headers_done:
            self.pool.put_back(self)
            return
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        self._finishing = asyncio.get_running_loop().call_later(FINISH_S, self.close)

    def _close_delimited(self) -> bool:
        return self.content_length is None and not self.keep_alive

    def _fail(self, failure: BaseException) -> None:
        self.failure = failure
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class ProviderResponse:
    """An engine's answer: status and headers now, the body as it arrives.

    Read it to its end and ``release()`` it (the connection goes back to the
    pool), or ``close()`` it (the connection is dropped: the engine stops).
    ``async with`` does the one or the other. The body reader is shaped as
    aiohttp's (``response.content.iter_any()``), so the reader of answers
    (``answer_read``) serves the node's other adapters too.
    """

    __slots__ = (
        "_done",
        "_exchange",
        "content",
        "content_length",
        "content_type",
        "status",
        "url",
    )

    def __init__(self, url: str, exchange: Exchange) -> None:
        self.url = url
        self.status = exchange.status
        self.content_type = exchange.content_type
        """The media type, lower case, without parameters (``""`` when not given)."""
        self.content_length = exchange.content_length
        self.content = self
        self._exchange = exchange
        self._done = False

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive; ``ProviderConnectionLost`` if it is cut off.

        A reader that stops before the end closes it (``contextlib.aclosing``, as the SSE
        reader does at ``[DONE]``): one left open is closed by asyncio's finalizer, from a
        task scheduled through ``call_soon_threadsafe``, which is correct but costs more.
        """
        exchange = self._exchange
        while True:
            if exchange.body:
                chunk = exchange.body.popleft()
                exchange.buffered -= len(chunk)
                if exchange.paused and exchange.buffered <= HIGH_WATER // 4:
                    exchange.resume()
                yield chunk
            elif exchange.complete:
                return
            elif exchange.failure is not None:
                raise exchange.failure
            else:
                waiter = exchange.waiter = asyncio.get_running_loop().create_future()
                await waiter

    __aiter__ = iter_any  # ``async for chunk in response`` reads the same

    async def read(self) -> bytes:
        """The whole body (for small answers: tokenizer calls)."""
        return b"".join([chunk async for chunk in self])

    def release(self) -> None:
        """Done with the response: its connection is pooled once the answer has ended
        (within ``FINISH_S``; else it is closed)."""
        if not self._done:
            self._done = True
            exchange = self._exchange
            if exchange.complete:  # read to its end: pooled now (``Exchange.release``)
                exchange.pool.put_back(exchange)
            else:
                exchange.release()

    def close(self) -> None:
        """Drop the connection now (the engine sees the disconnect)."""
        if not self._done:
            self._done = True
            self._exchange.close()
            self._exchange.pool.put_back(self._exchange)

    async def __aenter__(self) -> ProviderResponse:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.release()
        else:
            self.close()
