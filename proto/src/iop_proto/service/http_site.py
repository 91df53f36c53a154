"""An aiohttp site with a cap on the connections it holds: accept backpressure, as HAProxy's
``maxconn`` and nginx's ``worker_connections`` do it.

Every service's HTTP port shares its event loop with what must keep a deadline (the
edge's node links beat every 2 s; a peer silent for 6 s is dropped). aiohttp's own
``TCPSite`` accepts whatever arrives: under uvloop, every connection waiting in the
backlog in one callback, and then each one's request parsed and handled in the same
loop iterations. Ten thousand requests sent at once on open connections made each
iteration seconds long, and the links' heartbeats missed their verdict.

Here the site runs its own accept loop. It serves at most ``max_connections`` at once,
so the work one loop iteration can hold is bounded by the cap, whatever the clients send.
A connection over the cap is refused cheaply: no parser, no task, no handler; it gets a
canned answer (``refusal``: a 503 with ``Retry-After``) as soon as it is accepted, and is
closed once the client has read it (a close with its request unread would reset the
connection and could lose the answer). ``REFUSALS_PER_CONNECTION`` times as many refusals as
``max_connections`` may linger at once; past that too, the site stops accepting and new
connections wait in the kernel's backlog (``backlog`` of them, then the kernel drops
their SYNs and the clients retry), costing this process nothing until one closes.
Accepting yields to the loop every ``ACCEPT_BATCH`` connections, so a full backlog is
taken in steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable
from typing import Any, Final, cast

from aiohttp import web
from loguru import logger

ClosingFactory = Callable[[Callable[[], None]], asyncio.Protocol]
"""Makes a connection's protocol, given what it calls once when the connection is lost."""
ACCEPT_BATCH: Final = 32
"""Connections accepted before the loop runs anything else."""
ACCEPT_RETRY_S: Final = 0.1  # after EMFILE and the like: the listener stays, the loop breathes
DEFAULT_BACKLOG: Final = 1024  # the kernel caps it at net.core.somaxconn
REFUSALS_PER_CONNECTION: Final = 4
"""Refused connections still closing, per connection served: each holds a descriptor and
nothing else, and a client slow to read its 503 must not stop the refusals of others."""
REFUSAL_LINGER_S: Final = 2.0
"""A refused connection is closed this long after it was accepted, whatever the client
does: the answer had time to leave, and a silent client holds no descriptor longer."""


def canned_response(
    status: int, reason: str, body: bytes, content_type: str, retry_after_s: int = 1
) -> bytes:
    """A whole HTTP/1.1 response that closes its connection (``CappedSite``'s refusal)."""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


DEFAULT_REFUSAL: Final = canned_response(
    503, "Service Unavailable", b"too many connections; retry shortly\n", "text/plain"
)


class CappedSite(web.BaseSite):
    """Serve ``runner``'s application on ``host``:``port`` (the first address it resolves
    to), at most ``max_connections`` connections at once; others get ``refusal``."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        backlog: int = DEFAULT_BACKLOG,
        refusal: bytes = DEFAULT_REFUSAL,
        refusal_linger_s: float = REFUSAL_LINGER_S,
        protocol_factory: Callable[[Callable[[], asyncio.Protocol]], ClosingFactory] | None = None,
    ) -> None:
        """``protocol_factory``: given the runner's protocol factory, the one connections
        get instead (a front that hands some of them on to aiohttp's protocol); its
        protocols call the ``on_close`` they are made with once, when the connection is
        lost, as ``_Counted`` does for aiohttp's."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        super().__init__(runner, backlog=backlog)
        self._host = host
        self.port = port  # the bound one once started (port 0 picks a free one)
        self.max_connections = max_connections
        self.open_connections = 0
        self.refusing = 0  # refused connections not closed yet
        self.refused = 0  # since start
        self._refusal = refusal
        self._refusal_linger_s = refusal_linger_s
        self._protocol_factory = protocol_factory
        self._room = asyncio.Event()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handing_over: set[asyncio.Task[Any]] = set()

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self._host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, address = infos[0]
        listener = socket.create_server(address, family=family, backlog=self._backlog)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_forever(listener), name=self.name)

    async def stop(self) -> None:
        """Stop accepting (new connections are refused by the OS); connections open go on
        (the runner's ``cleanup`` ends them)."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await super().stop()

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None  # BaseSite: the runner was set up
        factory: ClosingFactory = functools.partial(_Counted, server)
        if self._protocol_factory is not None:
            factory = self._protocol_factory(server)
        since_yield = 0
        full_logged = False
        try:
            while True:
                full = self.open_connections >= self.max_connections
                if full and self.refusing >= self.max_connections * REFUSALS_PER_CONNECTION:
                    self._room.clear()  # backpressure: the kernel's backlog holds the rest
                    await self._room.wait()
                    continue
                if since_yield >= ACCEPT_BATCH:
                    since_yield = 0
                    await asyncio.sleep(0)  # a full backlog is taken in steps
                    continue  # room may have changed meanwhile
                try:
                    sock, _ = await loop.sock_accept(listener)
                except OSError as exc:  # out of fds, aborted before accept ...
                    logger.warning("{}: accept failed: {}", self.name, exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                    continue
                since_yield += 1
                if self.open_connections >= self.max_connections:
                    if not full_logged:
                        logger.warning(
                            "{}: {} connections open, the most allowed; refusing new ones"
                            " (503) until some close",
                            self.name,
                            self.open_connections,
                        )
                        full_logged = True
                    self._refuse(loop, sock)
                    continue
                if full_logged and self.open_connections < self.max_connections // 2:
                    full_logged = False  # the next time it fills is news again
                self.open_connections += 1
                task = asyncio.create_task(self._hand_over(sock, factory))
                self._handing_over.add(task)
                task.add_done_callback(self._handing_over.discard)
        finally:
            for task in list(self._handing_over):
                task.cancel()

    async def _hand_over(self, sock: socket.socket, factory: ClosingFactory) -> None:
        """Make ``sock`` a connection of the aiohttp server; its slot is freed when it closes
        (or here, when it never became one)."""
        loop = asyncio.get_running_loop()
        released = False

        def release() -> None:  # once: a transport closed on failure reports its loss too
            nonlocal released
            if not released:
                released = True
                self.open_connections -= 1
                self._room.set()

        try:
            await loop.connect_accepted_socket(functools.partial(factory, release), sock)
        except asyncio.CancelledError:
            sock.close()
            release()
            raise
        except OSError as exc:  # the client left before its connection was set up
            sock.close()
            release()
            logger.debug("{}: a connection failed as it was set up: {}", self.name, exc)

    def _refuse(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """Answer ``refusal`` on ``sock`` and close it, through a protocol of a few lines:
        the cheapest a connection can be answered."""
        self.refusing += 1
        self.refused += 1
        released = False

        def done() -> None:  # once: when the refusal closes, or when it never was set up
            nonlocal released
            if not released:
                released = True
                self.refusing -= 1
                self._room.set()

        def set_up(task: asyncio.Task[Any]) -> None:
            self._handing_over.discard(task)
            if task.cancelled() or task.exception() is not None:
                sock.close()
                done()

        task = asyncio.create_task(
            loop.connect_accepted_socket(
                lambda: _Refusal(self._refusal, self._refusal_linger_s, done), sock
            )
        )
        self._handing_over.add(task)
        task.add_done_callback(set_up)


class _Refusal(asyncio.Protocol):
    """A connection over the cap: the canned answer and a FIN at once, then whatever the
    client sends read and dropped until it closes (or ``linger_s`` passes:
    ``REFUSAL_LINGER_S`` by default). Closing with its request unread would make the
    kernel reset the connection, and the client could lose the answer."""

    __slots__ = ("_answer", "_done", "_linger_s", "_timer")

    def __init__(self, answer: bytes, linger_s: float, done: Callable[[], None]) -> None:
        self._answer = answer
        self._linger_s = linger_s
        self._done: Callable[[], None] | None = done
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport.write(self._answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(self._linger_s, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request of a connection refused: read only so the close stays clean

    def eof_received(self) -> bool:
        return False  # the client read its answer and closed: the transport closes too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        done, self._done = self._done, None
        if done is not None:
            done()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, which tells the site when it closes."""

    __slots__ = ("_inner", "_on_close")

    def __init__(self, make: Callable[[], asyncio.Protocol], on_close: Callable[[], None]) -> None:
        self._inner = make()
        self._on_close: Callable[[], None] | None = on_close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                on_close()
