"""A TCP server that does the TLS handshake itself, so every refusal can be named and counted.

``asyncio.start_server(ssl=...)`` fails handshakes out of the server's sight (the
loop only logs them in debug mode). Accepting plain TCP and calling
``StreamWriter.start_tls`` afterwards loses bytes instead: a client sends its
ClientHello at once, and a loop that starts reading the accepted socket before
the handler upgrades it (uvloop always does; asyncio's own loop when the handler
yields first) leaves the hello in the plaintext reader, and the handshake waits
for it until its timeout. Here nothing reads an accepted socket before the TLS
protocol owns it: the socket comes from ``sock_accept`` and is handed to
``connect_accepted_socket``, whose handshake error is ours to catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable

from loguru import logger

from iop_proto.tls import TlsRefused, refusal_reason
from iop_proto.tls_explain import (
    PEER_CLOSED,
    PEER_CLOSED_REASON,
    explain_server_rejection,
    peer_closed_during_handshake,
)

StreamHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
RefusalHandler = Callable[[TlsRefused, object], None]
"""Called with the refusal and the peer's address; the connection is already closed."""

ACCEPT_RETRY_S = 0.1  # after EMFILE and the like: the listener stays, the loop breathes
STREAM_LIMIT = 2**16  # asyncio.start_server's default buffer limit


class StreamServer:
    """Accepts connections on one address; each becomes ``handler(reader, writer)``.

    With ``context`` set, the handler only ever sees peers whose handshake
    succeeded; a failed one goes to ``on_refused`` with a reason code
    (``TlsRefused.reason``). Without it the streams are plaintext.
    """

    def __init__(
        self,
        handler: StreamHandler,
        context: ssl.SSLContext | None,
        on_refused: RefusalHandler,
        *,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        self._handler = handler
        self._context = context
        self._on_refused = on_refused
        self._handshake_timeout_s = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on the first address ``host`` resolves to; returns the bound port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        listener = socket.create_server(address, family=family, backlog=1024)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_forever(listener))
        return self.port

    def close(self) -> None:
        """Stop accepting and abandon handshakes in progress; handlers already running go on."""
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def wait_closed(self) -> None:
        if self._accepting is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    sock, peer = await loop.sock_accept(listener)
                except OSError as exc:  # out of fds, aborted before accept ...
                    logger.warning("accept failed: {}", exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                    continue
                task = asyncio.create_task(self._connection(sock, peer))
                self._connections.add(task)
                task.add_done_callback(self._connections.discard)
        finally:
            # A handshake still running belongs to nobody yet: end it with the server.
            for task in list(self._connections):
                task.cancel()

    async def _connection(self, sock: socket.socket, peer: object) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            if self._context is None:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            else:
                # Our own timeout, so a silent peer surfaces as TimeoutError (the loop's
                # own handshake timeout aborts with a ConnectionAbortedError instead).
                async with asyncio.timeout(self._handshake_timeout_s):
                    transport, _ = await loop.connect_accepted_socket(
                        lambda: protocol,
                        sock,
                        ssl=self._context,
                        ssl_handshake_timeout=self._handshake_timeout_s + 1,
                    )
        except (ssl.SSLError, ConnectionError, TimeoutError, OSError) as exc:
            sock.close()
            self._on_refused(handshake_failure(exc), peer)
            return
        # Handed over: from here the handler owns the connection, and the server's
        # close() no longer cancels it (the handler's owner ends it its own way).
        task = asyncio.current_task()
        if task is not None:
            self._connections.discard(task)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        await self._handler(reader, writer)


def handshake_failure(exc: BaseException) -> TlsRefused:
    """A failed handshake as the listener reports it: a reason code, and in words what
    did not match (when we rejected the peer) or that the peer closed (when it did)."""
    if peer_closed_during_handshake(exc):
        return TlsRefused(PEER_CLOSED_REASON, PEER_CLOSED)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TlsRefused(refusal_reason(exc), explain_server_rejection(exc))
    return TlsRefused(refusal_reason(exc), str(exc) or type(exc).__name__)
