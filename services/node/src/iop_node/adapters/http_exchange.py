"""One connection to an engine: its request, its answer parsed by llhttp, read as it comes.

``Exchange`` is the asyncio protocol of one keep-alive connection, one request
at a time; httptools (llhttp, Node.js's parser; uvicorn's too) cuts the status
line, the headers and the body (``Content-Length``, chunked, or until the
connection closes) out of what arrives, into the ``ProviderResponse`` of the
request out: one answer's state, made with its request, and what a caller reads.
``provider_http`` sends the requests and pools the connections.
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
    """One connection to an engine; one request and its answer at a time.

    The parser's callbacks fill in ``answer``, the ``ProviderResponse`` of the request
    out (or of the last one): its status, headers and body as they come.
    """

    def __init__(self, pool: Keeper, origin: str) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self.answer: ProviderResponse | None = None
        # What the reader waits on (``wait``): resolved once a read from the socket was
        # parsed (or the connection failed), whatever it brought.
        self._waiter: asyncio.Future[None] | None = None
        self.paused = False  # the socket is not read: the reader is behind
        self._finishing: asyncio.TimerHandle | None = None  # released before its end

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer.complete:  # nothing asked: a server out of step
            self._fail(ProviderConnectionLost("data from the engine while no request was out"))
            return
        answer.received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProviderConnectionLost(f"not a valid HTTP response: {exc}"))
            return
        if not answer.headers_done and answer.received > MAX_HEADER_BYTES:
            self._fail(ProviderConnectionLost(f"headers over {MAX_HEADER_BYTES} bytes"))
            return
        # The reader is woken once per read, after the parser took all of it: it finds
        # the headers, the body's chunks and the end together, however many there were.
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None
        self.pool.forget(self)
        answer = self.answer
        if answer is not None and not answer.complete:
            if answer.headers_done and answer.content_length is None and not answer.keep_alive:
                answer.complete = True  # a body without length or chunks ends with the connection
            elif answer.failure is None:
                why = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
                answer.failure = ProviderConnectionLost(why)
        self._wake()

    def pause_writing(self) -> None:  # a request body larger than the socket's buffers
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks: only ever from ``data_received``, with an answer to fill in

    def on_header(self, name: bytes, value: bytes) -> None:
        # Only what a reader of the answer needs; llhttp has checked the syntax.
        answer = self.answer
        assert answer is not None
        lowered = name.lower()
        if lowered == b"content-type":
            answer.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif lowered == b"content-length" and value.strip().isdigit():
            answer.content_length = int(value)

    def on_headers_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        if answer.complete:  # a second answer in the read that completed the first
            self._fail(ProviderConnectionLost("an answer from the engine nobody asked for"))
            return
        answer.status = self._parser.get_status_code()
        if 100 <= answer.status < 200:  # an interim answer (none is asked for): skip it
            answer.content_type, answer.content_length = "", None
            return
        answer.headers_done = True
        answer.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        assert answer is not None
        if answer.complete:
            return
        answer.buffered += len(body)
        if self._finishing is not None:  # nobody reads it: counted, dropped
            if answer.buffered > FINISH_BYTES:
                self.close()
            return
        answer.body.append(body)
        if answer.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        if answer.headers_done and not answer.complete:
            answer.complete = True
            if self._finishing is not None:
                self._finishing.cancel()
                self._finishing = None
                self.pool.put_back(self)

    # -- the client's side

    async def wait(self) -> None:
        """Until the parser took the next read from the socket, or the connection failed."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def resume(self) -> None:
        """The reader caught up: read the socket again."""
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()

    def close(self) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None
        if self.transport is not None:
            self.transport.close()

    def release(self, answer: ProviderResponse) -> None:
        """The caller is done with ``answer``, the one out: pooled now if it is complete,
        else once it is (``FINISH_S``, ``FINISH_BYTES``), else closed."""
        if answer.complete or answer.failure is not None or not answer.headers_done:
            self.pool.put_back(self)
            return
        answer.body.clear()
        answer.buffered = 0
        if self.paused:
            self.resume()
        self._finishing = asyncio.get_running_loop().call_later(FINISH_S, self.close)

    def _fail(self, failure: BaseException) -> None:
        if self.answer is not None:
            self.answer.failure = failure
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class ProviderResponse:
    """An engine's answer: status and headers, then the body as it arrives.

    Made as its request goes out, and filled in by its connection's parser
    (``Exchange``); a caller gets it once the headers are in. Read it to its end and
    ``release()`` it (the connection goes back to the pool), or ``close()`` it (the
    connection is dropped: the engine stops). ``async with`` does the one or the
    other. The body reader is shaped as aiohttp's (``response.content.iter_any()``),
    so the reader of answers (``answer_read``) serves the node's other adapters too.
    """

    __slots__ = (
        "_done",
        "_exchange",
        "body",
        "buffered",
        "complete",
        "content",
        "content_length",
        "content_type",
        "failure",
        "headers_done",
        "keep_alive",
        "received",
        "status",
        "url",
    )

    def __init__(self, url: str, exchange: Exchange) -> None:
        self.url = url
        self.status = 0
        self.content_type = ""
        """The media type, lower case, without parameters (``""`` when not given)."""
        self.content_length: int | None = None
        self.received = 0  # bytes of this answer so far (headers included)
        self.headers_done = False
        self.keep_alive = False  # read at the headers: llhttp forgets it after the body
        self.complete = False
        self.failure: BaseException | None = None
        self.body: collections.deque[bytes] = collections.deque()  # parsed, not yet read
        self.buffered = 0  # the bytes in ``body`` (once released: those dropped)
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
        body = self.body
        while True:
            if body:
                chunk = body.popleft()
                self.buffered -= len(chunk)
                if exchange.paused and self.buffered <= HIGH_WATER // 4:
                    exchange.resume()
                yield chunk
            elif self.complete:
                return
            elif self.failure is not None:
                raise self.failure
            else:
                await exchange.wait()

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
            if self.complete:  # read to its end: pooled now (``Exchange.release``)
                exchange.pool.put_back(exchange)
            else:
                exchange.release(self)

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
