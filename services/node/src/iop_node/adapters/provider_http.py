"""The node's HTTP/1.1 client for OpenAI-compatible engines: keep-alive pool, llhttp parser.

Every run is one POST to an engine (and a probe is a GET), so this client is on
every run's path. It does what those exchanges need and nothing more: a pool of
keep-alive connections per ``scheme://host:port`` with a limit on open connections,
``http`` and ``https`` (the system's CAs, the host's name checked), a bound on the
connect alone (a generation is bounded by its run's deadline, outside), a response
read as it arrives, and a response's connection closed, never pooled, whenever it
was not read to its end: a run cancelled or refused mid-answer drops the
connection, so the engine sees the disconnect and stops generating.

One connection's exchange, parsed by httptools (llhttp), is ``http_exchange``'s.
Compared with
aiohttp's ``ClientSession`` (kept for the node's other adapters) this costs a
third of the CPU per exchange (``tools/hardening/provider_client.py``). Not done:
redirects, cookies, proxies and compression (no ``Accept-Encoding`` is sent, so
answers come as they are), none of which an engine's API uses.

Failures are ``ProviderHttpError``s: ``ProviderConnectError`` when no request
reached a server (refused, DNS, TLS, connect timeout), ``ProviderConnectionLost``
when the connection broke or the answer was no valid HTTP.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from iop_node.adapters.http_exchange import (
    Exchange,
    ProviderConnectError,
    ProviderConnectionLost,
    ProviderHttpError,
    ProviderResponse,
)

__all__ = [
    "ProviderConnectError",
    "ProviderConnectionLost",
    "ProviderHttp",
    "ProviderHttpError",
    "ProviderResponse",
]

DEFAULT_LIMIT: Final = 100
"""Open connections at most, all engines together (aiohttp's connector's default)."""
KEEPALIVE_S: Final = 15.0
"""How long an idle pooled connection is kept (aiohttp's default too)."""
USER_AGENT: Final = b"iop-node"
MAX_PLACES: Final = 1024  # parsed URLs and their requests' heads kept
CLOSE_S: Final = 2.0
"""How long ``aclose`` waits for the connections to close (a TLS one says goodbye)."""


class _Pool:
    """Idle connections by origin, and the count of open ones under one limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0  # connections being made, in use or idle
        self.idle: dict[str, list[Exchange]] = {}
        self._counted: set[Exchange] = set()
        self._changed: asyncio.Future[None] | None = None

    async def acquire(self, origin: str) -> Exchange | None:
        """An idle connection to ``origin``, or ``None`` with room taken for a new one.

        A pooled connection the server closed meanwhile, or idle past ``KEEPALIVE_S``,
        is passed over. At the limit, an idle connection to another engine is closed
        to make room; with none idle, this waits for a connection to come back or close.
        """
        idle = self.idle.get(origin)
        while True:
            while idle:
                exchange = idle.pop()
                transport = exchange.transport
                if transport is not None and not transport.is_closing():
                    if asyncio.get_running_loop().time() - exchange.idle_since < KEEPALIVE_S:
                        return exchange
                    transport.close()  # its connection_lost frees its room
            if self.open < self.limit or self._close_an_idle_one():
                self.open += 1
                return None
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)  # shared: one waiter's cancel is its own
            idle = self.idle.get(origin)

    def _close_an_idle_one(self) -> bool:
        for idle in self.idle.values():
            if idle:
                exchange = idle.pop(0)
                exchange.close()
                self.forget(exchange)
                return True
        return False

    def opened(self, exchange: Exchange) -> None:
        self._counted.add(exchange)

    def unmade(self) -> None:
        """The room taken for a connection that was never made."""
        self.open -= 1
        self._notify()

    def put_back(self, exchange: Exchange) -> None:
        transport, answer = exchange.transport, exchange.answer
        if (
            answer is not None  # read to its end, all of it taken, and still open
            and answer.complete
            and not answer.body
            and answer.keep_alive
            and transport is not None
            and not transport.is_closing()
        ):
            exchange.idle_since = asyncio.get_running_loop().time()
            self.idle.setdefault(exchange.origin, []).append(exchange)
            changed = self._changed
            if changed is not None and not changed.done():
                changed.set_result(None)  # as ``_notify``
        else:
            exchange.close()
            self.forget(exchange)

    def forget(self, exchange: Exchange) -> None:
        """The connection is closed (or closing): its room is free."""
        idle = self.idle.get(exchange.origin)
        if idle and exchange in idle:
            idle.remove(exchange)
        if exchange in self._counted:
            self._counted.discard(exchange)
            self.open -= 1
            self._notify()

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    async def all_closed(self) -> None:
        while self._counted:
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)

    def abort_all(self) -> None:
        for exchange in list(self._counted):
            if exchange.transport is not None:
                exchange.transport.abort()

    def close_all(self) -> None:
        """Close every connection: idle, finishing an answer, or still being read."""
        for exchange in list(self._counted):
            exchange.close()
        self.idle.clear()


@dataclass(frozen=True, slots=True)
class _Place:
    """A URL as a request needs it: where to connect, and the request line's target."""

    origin: str
    scheme: str
    host: str
    port: int
    netloc: str
    target: str

    @classmethod
    def of(cls, url: str) -> _Place:
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or ""
        if scheme not in ("http", "https") or not host:
            raise ProviderConnectError(f"{url}: not an http:// or https:// URL")
        port = parts.port or (443 if scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(f"{scheme}://{host}:{port}", scheme, host, port, parts.netloc, target)


class ProviderHttp:
    """The node's client for its engines' HTTP APIs; one per node, closed with it."""

    def __init__(self, *, limit: int = DEFAULT_LIMIT, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: how ``https`` engines are checked; by default the system's CAs and the
        host's name (``ssl.create_default_context``), made on first use."""
        self._pool = _Pool(limit)
        self._tls = tls
        self._closed = False
        self._places: dict[tuple[object, ...], tuple[_Place, bytes]] = {}

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        connect_timeout_s: float,
    ) -> ProviderResponse:
        """Send one request and return once the response's headers are in.

        A connection reused from the pool that fails before any byte of an answer
        came back is one the server closed while it was idle: the request is sent
        once more on a new connection.
        """
        if self._closed:
            raise ProviderConnectError("the node's HTTP client is closed")
        # An adapter sends the same headers to the same URLs run after run: the head
        # up to its length is made once per (method, URL, headers) and kept.
        key = (method, url, *headers.items())
        known = self._places.get(key)
        if known is None:
            place = _Place.of(url)
            known = self._places[key] = place, _request_head(method, place, headers)
            if len(self._places) > MAX_PLACES:  # engines' URLs are few; any others pass
                self._places.clear()
        place, head = known
        origin, scheme, host, port = place.origin, place.scheme, place.host, place.port
        if body or method not in ("GET", "HEAD"):
            request = b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
        else:
            request = head + b"\r\n"
        while True:
            exchange = await self._pool.acquire(origin)
            reused = exchange is not None
            if exchange is None:
                exchange = await self._connect(origin, scheme, host, port, connect_timeout_s)
            assert exchange.transport is not None
            response = exchange.answer = ProviderResponse(url, exchange)
            try:
                exchange.transport.write(request)
                while not response.headers_done:
                    if response.failure is not None:
                        raise response.failure
                    await exchange.wait()
            except ProviderConnectionLost:
                exchange.close()
                self._pool.forget(exchange)
                if reused and response.received == 0:
                    continue
                raise
            except BaseException:
                exchange.close()  # cancelled or timed out before the answer began
                self._pool.forget(exchange)
                raise
            return response

    async def _connect(
        self, origin: str, scheme: str, host: str, port: int, timeout_s: float
    ) -> Exchange:
        pool = self._pool
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if scheme == "https" else None
        try:
            async with asyncio.timeout(timeout_s):
                transport, exchange = await loop.create_connection(
                    lambda: Exchange(pool, origin), host, port, ssl=tls
                )
        except TimeoutError:
            pool.unmade()
            raise ProviderConnectError(f"{origin}: no connection within {timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            pool.unmade()
            raise ProviderConnectError(f"{origin}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            pool.unmade()
            raise
        # uvloop may return before it called connection_made: the transport is known now
        exchange.transport = transport
        pool.opened(exchange)
        return exchange

    @property
    def idle_connections(self) -> int:
        """Connections pooled for a next request (a plain count, for tests)."""
        return sum(len(idle) for idle in self._pool.idle.values())

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def aclose(self) -> None:
        """Close every connection (the node stops: its runs have ended), and wait up to
        ``CLOSE_S`` until they are closed; those still open then are aborted."""
        self._closed = True
        self._pool.close_all()
        try:
            async with asyncio.timeout(CLOSE_S):
                await self._pool.all_closed()
        except TimeoutError:
            self._pool.abort_all()


def _request_head(method: str, place: _Place, headers: Mapping[str, str]) -> bytes:
    """A request's head up to its length: each line ends, the blank line is to come."""
    lines = [f"{method} {place.target} HTTP/1.1", f"Host: {place.netloc}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    lines.append(f"User-Agent: {USER_AGENT.decode()}")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")
