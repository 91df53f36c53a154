"""Dialing a peer and staying registered: the node and the worker dial the edge, the
edge dials the control-plane.

A node or worker dials the edge (never the reverse, so it may sit behind NAT),
opens TLS, sends its ``RegisterRequest``, waits for the answer, serves the
connection until it ends, and after any loss waits a jittered, growing delay
and dials again, until stopped or cancelled. A certificate of the edge that does not
fit our TLS settings (a name it lacks, another CA, an expiry) ends the loop with
``TlsMismatch`` instead: only an operator can fix it (``iop_proto.tls_explain``). A
refused registration is retried: the edge tells a refused peer only that it was
refused (not whether the token was bad or the control-plane away, which is for the
operator's eyes), so the node cannot tell a lasting refusal from a passing one.

``Dialer`` is that loop; a service subclasses it and says what it registers with,
what it does with an accepted registration, how it serves a registered connection,
and what it cleans up after one. The edge's link to the control-plane uses the same
loop with its own handshake (``_register``: its hello, answered by the fleet config)
and keeps dialing past a certificate that does not fit (``fatal_tls_mismatch``): it
serves its cached config meanwhile, and the certificate may be fixed under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from loguru import logger

from iop_proto.connection import DEFAULT_HEARTBEAT_INTERVAL, Connection
from iop_proto.errors import ConnectionClosed, ProtocolError, UnexpectedMessage
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.tls import TlsSettings
from iop_proto.tls_explain import PEER_CLOSED, peer_closed_during_handshake, rejection
from iop_proto.v1 import runtime_pb2 as pb


def code_name(code: int) -> str:
    """``ERROR_CODE_...`` for a known code, the number for one from a newer peer."""
    try:
        return pb.ErrorCode.Name(code)
    except ValueError:
        return str(code)


class EdgeAddress(Protocol):
    """The ``edge`` section of a dialing service's settings."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def server_name(self) -> str | None: ...


class Backoff(Protocol):
    """The ``reconnect`` section of a dialing service's settings."""

    @property
    def initial_s(self) -> float: ...
    @property
    def max_s(self) -> float: ...


class LinkGauge(Protocol):
    """Where a dialer shows its link's state (1 up, 0 down): a Prometheus gauge."""

    def set(self, value: float) -> None: ...


class DialingService(Protocol):
    """The settings of a service that dials the edge (the node's, the worker's)."""

    @property
    def service_id(self) -> str: ...
    @property
    def edge(self) -> EdgeAddress: ...
    @property
    def reconnect(self) -> Backoff: ...


@dataclass(frozen=True, slots=True)
class DialSettings:
    """Where to dial and how patiently; a service fills it from its own settings."""

    host: str
    port: int
    server_name: str | None
    """The name the edge's certificate must carry; ``None``: ``host``."""
    sender_id: str
    register_timeout_s: float
    """Bounds the TCP and TLS handshakes, and then the wait for the registration's answer."""
    initial_delay_s: float
    max_delay_s: float
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    tls_files: TlsSettings | None = None
    """Our certificate files: named in the explanation of a failed handshake."""
    peer: str = "edge"
    """The dialed service, as log lines name it."""
    setting: str = "edge"
    """The settings section that says where the peer is (named when its certificate
    does not fit)."""
    fatal_tls_mismatch: bool = True
    """A peer certificate that does not fit ends the loop (``TlsMismatch``); ``False``:
    log it and keep dialing."""
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL
    """Until the registration's answer says otherwise."""

    @classmethod
    def of(
        cls,
        settings: DialingService,
        register_timeout_s: float,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        edge: EdgeAddress | None = None,
    ) -> DialSettings:
        """From a service's settings: its id, ``edge`` (or the ``edge`` given: one of its
        ``edges``) and ``reconnect`` sections."""
        edge = settings.edge if edge is None else edge
        return cls(
            host=edge.host,
            port=edge.port,
            server_name=edge.server_name,
            sender_id=settings.service_id,
            register_timeout_s=register_timeout_s,
            initial_delay_s=settings.reconnect.initial_s,
            max_delay_s=settings.reconnect.max_s,
            max_frame_size=max_frame_size,
            tls_files=getattr(settings, "tls", None),
        )


EdgesHeard = Callable[["Dialer", Sequence[pb.EdgeEndpoint]], None]
"""Told each registration's and each push's list of edges (``iop_proto.edges.EdgeLinks``)."""


class Dialer:
    """Keeps a service registered with the edge for as long as it runs.

    ``registered`` is set while a registration holds (readiness reads it);
    ``registrations`` counts accepted ones; ``edge_id`` is the id of the edge that
    accepted the last one. A subclass implements ``_register_request`` and ``_serve``,
    and may override ``_accepted`` and ``_disconnected``; a peer that is not the edge
    overrides ``_register``. ``on_edges`` hears the edges the edge lists (the
    registration's answer, then ``_heard_edges`` for each push a subclass receives).
    """

    def __init__(
        self, dial: DialSettings, tls: ssl.SSLContext | None, edge_connected: LinkGauge
    ) -> None:
        self._dial = dial
        self._tls = tls
        self._edge_connected = edge_connected
        self._stopping = asyncio.Event()
        self.registered = asyncio.Event()
        self.registrations = 0
        self.edge_id = ""
        self.on_edges: EdgesHeard | None = None

    @property
    def dial(self) -> DialSettings:
        """Where this link dials."""
        return self._dial

    def _heard_edges(self, edges: Sequence[pb.EdgeEndpoint]) -> None:
        """The edge listed the fleet's edges (empty: it knows of none)."""
        if self.on_edges is not None:
            self.on_edges(self, edges)

    # -- what a subclass says ------------------------------------------------------

    def _register_request(self) -> pb.RegisterRequest:
        raise NotImplementedError

    async def _accepted(self, conn: Connection, response: pb.RegisterResponse) -> str:
        """The edge accepted: take what it sent; returns a detail for the log line."""
        return ""

    async def _serve(self, conn: Connection) -> None:
        """Serve a registered connection until it ends (return) or breaks (raise)."""
        raise NotImplementedError

    async def _disconnected(self) -> None:
        """After each connection, registered or not, has been closed."""

    async def _register(self, conn: Connection) -> str | None:
        """The registration's exchange: the detail for the "registered" log line when the
        peer accepted, ``None`` when it refused (logged here). This one is the edge's
        ``RegisterRequest``/``RegisterResponse``."""
        sent = await conn.send(self._register_request())
        async with asyncio.timeout(self._dial.register_timeout_s):
            answer = await conn.receive()
        kind = answer.WhichOneof("body")
        if kind == "error":
            logger.error(
                "the edge refused the registration: {} ({})",
                answer.error.message,
                code_name(answer.error.code),
            )
            return None
        if kind != "register_response" or answer.correlation_id != sent.message_id:
            raise UnexpectedMessage(f"expected register_response, got {kind}")
        response = answer.register_response
        if not response.accepted:
            logger.error("the edge refused the registration: {}", response.reason)
            return None
        self.edge_id = response.edge_id
        detail = await self._accepted(conn, response)
        self._heard_edges(response.edges)
        if response.heartbeat_interval_ms:
            conn.heartbeat_interval = response.heartbeat_interval_ms / 1000
        return f"with edge {response.edge_id or conn.peer_name}{detail}"

    # -- the loop ------------------------------------------------------------------

    def stop(self) -> None:
        """Dial no more: the connection in hand ends when ``_serve`` returns."""
        self._stopping.set()

    def resume(self) -> None:
        """Undo ``stop`` while ``run`` still runs: it dials again after this connection."""
        self._stopping.clear()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self) -> None:
        """Connect, serve, and reconnect with jittered exponential backoff, until stopped
        (or until the edge's certificate proves not to fit: ``TlsMismatch``)."""
        delay = self._dial.initial_delay_s
        failures = 0
        while not self._stopping.is_set():
            registered = await self._connect_and_serve()
            if self._stopping.is_set():
                return
            if registered:
                delay, failures = self._dial.initial_delay_s, 0  # it worked: retry quickly
            failures += 1
            pause = delay * random.uniform(0.5, 1.5)
            peer = self._dial.peer
            logger.info("reconnecting to the {} in {:.1f}s (attempt {})", peer, pause, failures + 1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._stopping.wait()
            delay = min(delay * 2, self._dial.max_delay_s)

    async def _connect_and_serve(self) -> bool:
        """One connection's life; ``True`` when the edge accepted the registration."""
        dial = self._dial
        name = dial.server_name or dial.host
        try:
            async with asyncio.timeout(dial.register_timeout_s):
                reader, writer = await asyncio.open_connection(
                    dial.host,
                    dial.port,
                    ssl=self._tls,
                    server_hostname=name if self._tls else None,
                )
        except ssl.SSLCertVerificationError as exc:
            mismatch = await rejection(
                exc,
                host=dial.host,
                port=dial.port,
                server_name=name,
                settings=dial.tls_files,
                peer=dial.peer,
                setting=dial.setting,
                timeout_s=dial.register_timeout_s,
            )
            if dial.fatal_tls_mismatch:
                raise mismatch from None
            logger.error("{} at {}:{}: {}", dial.peer, dial.host, dial.port, mismatch)
            return False
        except (OSError, TimeoutError) as exc:
            where = f"{dial.peer} at {dial.host}:{dial.port}"
            if self._tls is not None and peer_closed_during_handshake(exc):
                logger.warning("{}: {}", where, PEER_CLOSED)
            elif isinstance(exc, ssl.SSLError):
                logger.warning("{}: TLS handshake failed: {}", where, exc)
            else:
                logger.warning("cannot reach the {}: {}", where, exc)
            return False
        conn = Connection(
            reader,
            writer,
            sender_id=dial.sender_id,
            max_frame_size=dial.max_frame_size,
            heartbeat_interval=dial.heartbeat_interval_s,
        )
        registered = False
        try:
            detail = await self._register(conn)
            registered = detail is not None
            if registered:
                conn.start_heartbeats()
                self.registrations += 1
                self.registered.set()
                self._edge_connected.set(1)
                logger.info("registered {}", detail)
                await self._serve(conn)
        except ProtocolError as exc:
            await conn.abort(exc)
            logger.warning("{} connection closed: {}", dial.peer, exc)
        except (ConnectionClosed, ConnectionError, TimeoutError) as exc:
            if registered or isinstance(exc, TimeoutError):
                logger.warning("{} connection lost: {}", dial.peer, exc or type(exc).__name__)
            else:
                logger.warning("{}", self._closed_before_answer())
        except Exception:
            # The outermost per-connection boundary: a bug must not end the link for good.
            logger.exception("{} connection failed", dial.peer)
        finally:
            self.registered.clear()
            self._edge_connected.set(0)
            await conn.close()
            await self._disconnected()
        return registered

    def _closed_before_answer(self) -> str:
        """The edge closed before answering the registration: with TLS 1.3 that is what
        a client sees when the server rejected its certificate (its handshake had
        already succeeded), so say so, and where the reason is."""
        peer = self._dial.peer
        if self._tls is None:
            return f"the {peer} closed the connection before answering the registration"
        files = self._dial.tls_files
        ours = f" (tls.cert_file {files.cert_file})" if files is not None else ""
        return (
            f"the {peer} closed the connection right after the TLS handshake, before answering "
            f"the registration: it most likely rejected our certificate{ours}, e.g. one not "
            f"signed by its CA or expired; the {peer}'s log says why"
        )
