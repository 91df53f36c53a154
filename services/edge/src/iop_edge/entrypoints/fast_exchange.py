"""One request and its answer on the inference front (``fast_front``): the ``ApiRequest``
the pipeline reads, the stream it writes (``StreamOut``), and a whole answer's bytes.

What aiohttp's ``web.Request`` and ``StreamResponse`` do for these routes, without
its per-request machinery (URL objects, the payload stream, signals, the writer's
layers): the body arrives through ``feed`` as the connection's parser reads it; a
stream's bytes leave as HTTP/1.1 chunks on the connection's transport.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from email.utils import formatdate
from typing import Any, Final, Protocol

from aiohttp import web
from multidict import CIMultiDict

CHUNK_END: Final = b"0\r\n\r\n"
CLOSING: Final = "Cannot write to closing transport"
"""aiohttp's words: a write to a connection that closed is a ``ConnectionResetError``,
which the pipeline reads as a client gone."""


class Connection(Protocol):
    """What an exchange needs of its connection (``fast_front``'s protocol)."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    @property
    def write_paused(self) -> bool: ...

    async def drained(self) -> None:
        """Return once the transport takes more (``ConnectionResetError``: it closed)."""
        ...


class FastRequest:
    """A request of the inference front: its head parsed, its body arriving (``feed``)."""

    __slots__ = (
        "_body",
        "_connection",
        "_error",
        "body_exists",
        "chunks",
        "complete",
        "content",
        "headers",
        "keep_alive",
        "max_bytes",
        "method",
        "path",
        "remote",
        "total_bytes",
        "waiter",
    )

    def __init__(
        self,
        connection: Connection,
        path: str,
        headers: CIMultiDict[str],
        *,
        remote: str | None,
        keep_alive: bool,
        max_bytes: int,
    ) -> None:
        self._connection = connection
        self.method = "POST"
        self.path = path
        self.headers: Mapping[str, str] = headers
        self.remote = remote
        self.keep_alive = keep_alive
        length = headers.get("Content-Length")
        self.body_exists = "Transfer-Encoding" in headers or (
            length is not None and length.strip() != "0"
        )
        self.content = self  # the body's progress (``api_request.BodyProgress``) is its own
        # The body as the connection's parser reads it (``fast_front``): its chunks up to
        # ``max_bytes`` (past it counted in ``total_bytes``, not kept), ``complete`` once
        # it has all arrived; ``waiter``: ``read`` waiting for more, woken by ``wake``.
        self.total_bytes = 0
        self.max_bytes = max_bytes
        self.chunks: list[bytes] = []
        self.complete = False
        self.waiter: asyncio.Future[None] | None = None
        self._body: bytes | None = None
        self._error: Exception | None = None

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._connection.transport

    def is_eof(self) -> bool:
        return self.complete

    async def read(self) -> bytes:
        """The whole body, once: ``web.HTTPRequestEntityTooLarge`` as soon as it passes the
        limit (as aiohttp's ``read``), the parser's error for a body it could not read."""
        while not (self.complete or self._error is not None or self.total_bytes > self.max_bytes):
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        if self.total_bytes > self.max_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.max_bytes, actual_size=self.total_bytes
            )
        if self._error is not None:
            raise self._error
        if self._body is None:
            self._body = b"".join(self.chunks)
            self.chunks.clear()
        return self._body

    def fail(self, error: Exception) -> None:
        self._error = error
        self.wake()

    def wake(self) -> None:
        """``read`` goes on: more of the body, its end, or its failure."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class FastStream:
    """A streamed answer (SSE): the status line and headers made at ``prepare`` and sent
    with the first ``write`` (the client reads nothing of a stream before its first
    chunk, so both leave in one packet), then each ``write`` as one HTTP/1.1 chunk,
    ``write_eof`` the last."""

    __slots__ = (
        "_connection",
        "_head",
        "_request",
        "finished",
        "headers",
        "keep_alive",
        "prepared",
    )

    def __init__(
        self, connection: Connection, request: FastRequest, headers: Mapping[str, str]
    ) -> None:
        self._connection = connection
        self._request = request
        self.headers: CIMultiDict[str] = CIMultiDict(headers)
        self.prepared = False
        self.finished = False
        self.keep_alive = request.keep_alive
        self._head = b""  # made, not sent yet

    async def prepare(self, request: Any) -> None:
        transport = self._connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(CLOSING)
        # the stream starts once the body was read: a connection that still has some of it
        # unread ends with the answer
        self.keep_alive = self.keep_alive and self._request.complete
        self._head = response_head(
            200, "OK", self.headers, "Transfer-Encoding: chunked\r\n", self.keep_alive
        )
        self.prepared = True

    async def write(self, data: bytes) -> None:
        if not data:
            return
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(CLOSING)
        transport.write(b"%b%x\r\n%b\r\n" % (self._head, len(data), data))
        self._head = b""
        if connection.write_paused:
            await connection.drained()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.finished:
            return
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(CLOSING)
        if data:
            transport.write(b"%b%x\r\n%b\r\n%b" % (self._head, len(data), data, CHUNK_END))
        else:
            transport.write(self._head + CHUNK_END)
        self._head = b""
        self.finished = True
        if connection.write_paused:
            await connection.drained()


def whole_answer(response: web.StreamResponse, keep_alive: bool) -> bytes:
    """A whole answer (an error, a non-streamed result) made by the pipeline as aiohttp's
    ``web.Response``, as bytes: its status, headers and body, with its length."""
    if not isinstance(response, web.Response):
        raise TypeError(f"a whole answer is a web.Response, not {type(response).__name__}")
    body = response.body
    if body is None:
        body = b""
    if not isinstance(body, bytes):
        raise TypeError(f"a whole answer's body is bytes, not {type(body).__name__}")
    head = response_head(
        response.status,
        response.reason,
        response.headers,
        f"Content-Length: {len(body)}\r\n",
        keep_alive and response.keep_alive is not False,
    )
    return head + body


_date_cache: tuple[int, str] = (0, "")
_FRAMING: Final = frozenset({"content-length", "transfer-encoding", "connection"})


def response_head(
    status: int, reason: str, headers: Mapping[str, str], framing: str, keep_alive: bool
) -> bytes:
    """The status line and headers; ``ValueError`` for a header that would break the head
    (a line break in a name or value), as aiohttp refuses one."""
    lines = [f"HTTP/1.1 {status} {reason}\r\n"]
    for name, value in headers.items():
        if name.lower() not in _FRAMING:
            lines.append(f"{name}: {value}\r\n")
    lines.append(framing)
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:  # the Date header, made once a second
        _date_cache = (now, formatdate(now, usegmt=True))
    lines.append(f"Date: {_date_cache[1]}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise ValueError("Newline or carriage return character detected in a header")
    return text.encode("utf-8")
