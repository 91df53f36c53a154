"""The IOP listener edges dial: config on connect, node authorizations, pushed changes.

One task per edge connection. The first frame must be ``edge_hello``; then the
edge may ask ``authorize_node_request`` any number of times and receives
``fleet_config`` pushes whenever the authority's snapshot changes. Only
certificates whose role is an edge's are accepted.
"""

from __future__ import annotations

import asyncio
import ssl

from loguru import logger

from iop_control_plane.authority import FleetAuthority
from iop_control_plane.entrypoints.controls import ControlDesk
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.settings import ControlPlaneSettings
from iop_proto.accept import StreamServer
from iop_proto.connection import Connection, error_body
from iop_proto.errors import ConnectionClosed, ProtocolError, UnexpectedMessage
from iop_proto.tls import TlsRefused
from iop_proto.tls_explain import PEER_CLOSED_REASON
from iop_proto.v1 import runtime_pb2 as pb

HELLO_TIMEOUT_S = 10.0


class EdgeSession:
    """One connected edge: answers its requests and forwards pushes to it."""

    def __init__(
        self, conn: Connection, authority: FleetAuthority, desk: ControlDesk | None = None
    ) -> None:
        self.conn = conn
        self.authority = authority
        self.desk = desk
        self.edge_id = conn.peer_name

    async def push(self, snapshot: pb.FleetConfig) -> None:
        try:
            await self.conn.send(snapshot)
        except ConnectionClosed:
            return  # the session's own loop notices and cleans up

    async def serve(self) -> None:
        hello = await asyncio.wait_for(self.conn.receive(), HELLO_TIMEOUT_S)
        if hello.WhichOneof("body") != "edge_hello":
            raise UnexpectedMessage(f"expected edge_hello first, got {hello.WhichOneof('body')}")
        self.edge_id = hello.edge_hello.edge_id or self.edge_id
        logger.info(
            "edge {} connected (version {}, has config {})",
            self.edge_id,
            hello.edge_hello.version or "?",
            hello.edge_hello.known_config_version,
        )
        listener = (
            hello.edge_hello.node_listener if hello.edge_hello.HasField("node_listener") else None
        )
        try:
            if listener is not None and listener.host and listener.port:
                # Listed before its first config: that config lists it too (the others
                # hear of it in the push this sends them).
                await self.authority.edge_joined(self, self.edge_id, listener)
            # Subscribe before sending so no change can fall between the two.
            self.authority.subscribe(self.push)
            await self.conn.send(self.authority.snapshot, correlation_id=hello.message_id)
            async for envelope in self.conn:
                await self._answer(envelope)
        finally:
            self.authority.unsubscribe(self.push)
            await self.authority.edge_lost(self.edge_id, self)

    async def _answer(self, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "authorize_node_request":
            decision = await self.authority.authorize(envelope.authorize_node_request)
            await self.conn.send(
                self.authority.authorization_response(decision),
                correlation_id=envelope.message_id,
            )
        elif kind == "runtime_control_request" and self.desk is not None:
            answer = await self.desk.answer(envelope.runtime_control_request)
            await self.conn.send(answer, correlation_id=envelope.message_id)
        elif kind == "node_status_report":
            await self.authority.record_node_status(self.edge_id, envelope.node_status_report)
        elif kind == "error":
            logger.warning("edge {} reported: {}", self.edge_id, envelope.error.message)
        else:
            raise UnexpectedMessage(f"the control-plane does not accept {kind} from an edge")


class EdgeServer:
    """Accepts edge connections over mTLS and runs one ``EdgeSession`` each."""

    def __init__(
        self,
        settings: ControlPlaneSettings,
        authority: FleetAuthority,
        metrics: ControlPlaneMetrics,
        tls: ssl.SSLContext | None,
        desk: ControlDesk | None = None,
    ) -> None:
        self._settings = settings
        self._authority = authority
        self._desk = desk  # runtime control changes (None: refused as unexpected)
        self._metrics = metrics
        self._tls = tls
        self._server: StreamServer | None = None
        self._sessions: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self.port = settings.listen.port

    async def start(self) -> int:
        listen = self._settings.listen
        # The handshake is the server's, its failures come back here to be named and counted.
        self._server = StreamServer(self._handle, self._tls, self._tls_refused)
        self.port = await self._server.start(listen.host, listen.port)
        logger.info("listening for edges on {}:{}", listen.host, self.port)
        return self.port

    async def aclose(self) -> None:
        """Stop accepting, tell each edge we are going, then end the sessions."""
        if self._server is not None:
            self._server.close()
        shutting_down = error_body(pb.ERROR_CODE_SHUTTING_DOWN, "control-plane is stopping")
        await asyncio.gather(
            *(conn.close(shutting_down) for conn in list(self._connections)),
            return_exceptions=True,
        )
        for task in list(self._sessions):
            task.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sessions.add(task)
        conn = Connection(
            reader,
            writer,
            sender_id=self._settings.service_id,
            max_frame_size=self._settings.max_frame_size,
            heartbeat_interval=self._settings.heartbeat_interval_s,
        )
        self._connections.add(conn)
        self._metrics.edges_connected.inc()
        conn.start_heartbeats()
        try:
            refusal = self._refusal(conn)
            if refusal is not None:
                logger.warning("refused {}: {}", conn.peer_name, refusal)
                await conn.close(error_body(pb.ERROR_CODE_PERMISSION_DENIED, refusal))
                return
            await EdgeSession(conn, self._authority, self._desk).serve()
        except ProtocolError as exc:
            await conn.abort(exc)  # a no-op when receive() already closed for it
            logger.info("edge connection {} ended: {}", conn.peer_name, exc)
        except TimeoutError:
            await conn.abort(UnexpectedMessage("no edge_hello within the time allowed"))
        except ConnectionClosed as exc:
            logger.info("edge connection {} ended: {}", conn.peer_name, exc)
        except Exception:
            # The per-connection boundary: one edge's failure never reaches the others.
            logger.exception("edge connection {} failed", conn.peer_name)
            await conn.close(error_body(pb.ERROR_CODE_INTERNAL, "internal error"))
        finally:
            await conn.close()
            self._metrics.edges_connected.dec()
            self._connections.discard(conn)
            self._sessions.discard(task)

    def _tls_refused(self, exc: TlsRefused, peer: object) -> None:
        self._metrics.tls_refusals.labels(exc.reason).inc()
        if exc.reason == PEER_CLOSED_REASON:  # not our refusal: the edge ended the handshake
            logger.warning("TLS handshake with {} ended: {}", peer, exc.detail)
        else:
            logger.warning("refused {} in TLS ({}): {}", peer, exc.reason, exc.detail)

    def _refusal(self, conn: Connection) -> str | None:
        """Why this peer may not talk to the control-plane, or ``None``."""
        if self._tls is None:
            return None  # plaintext mode has no identities; a warning was logged at start
        role = conn.peer.role if conn.peer else None
        if role in self._settings.edge_roles:
            return None
        return (
            f"certificate role (OU) {role!r} may not connect to the control-plane (edges only: "
            f"edge_roles is {', '.join(self._settings.edge_roles)}); dial it with the edge's "
            "certificate (devcerts --identity edge:edge)"
        )
