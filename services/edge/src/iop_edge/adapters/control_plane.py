"""The edge's link to the control-plane: fleet config and its pushes, node authorizations.

The last good config is kept on disk, so a control-plane outage (or an edge
restart during one) does not stop serving; node registrations fail closed
while the control-plane is away, because only it can vouch for a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from loguru import logger

from iop_edge.errors import ControlPlaneUnavailable
from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed, ProtocolError, UnexpectedMessage
from iop_proto.tasks import cancel_and_wait
from iop_proto.tls import TlsSettings
from iop_proto.tls_explain import PEER_CLOSED, peer_closed_during_handshake, rejection
from iop_proto.v1 import runtime_pb2 as pb

FleetListener = Callable[[pb.FleetConfig], Awaitable[None]]
REPORT_COALESCE_S = 0.2
"""How long a node status report waits for the ones right behind it (a reconnect storm)."""


class ControlPlaneClient:
    """Keeps a connection to the control-plane and the fleet config it serves."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        server_name: str | None,
        edge_id: str,
        version: str,
        tls: ssl.SSLContext | None,
        cache_file: Path,
        on_fleet: FleetListener,
        heartbeat_interval_s: float,
        reconnect_max_s: float,
        authorize_timeout_s: float,
        on_link: Callable[[bool], None] | None = None,
        tls_files: TlsSettings | None = None,
    ) -> None:
        """``on_link``: told ``True`` when a connection is up (its first config applied)
        and ``False`` when it is lost, so the edge can show the link's state."""
        self._host, self._port = host, port
        self._on_link = on_link
        self._server_name = server_name or host
        self._edge_id = edge_id
        self._version = version
        self._tls = tls
        self._tls_files = tls_files  # named when the control-plane's certificate does not fit
        self._cache_file = cache_file
        self._on_fleet = on_fleet
        self._heartbeat_interval_s = heartbeat_interval_s
        self._reconnect_max_s = reconnect_max_s
        self._authorize_timeout_s = authorize_timeout_s
        self._conn: Connection | None = None
        self._pending: dict[str, asyncio.Future[pb.AuthorizeNodeResponse]] = {}
        self._node_report = pb.NodeStatusReport()  # the latest, sent again on each connect
        self._report_task: asyncio.Task[None] | None = None  # at most one send pending
        self.config: pb.FleetConfig | None = None
        self.connected = asyncio.Event()

    # ------------------------------------------------------------ config

    async def load_cache(self) -> bool:
        """Serve the last good config from disk until the control-plane answers."""
        try:
            data = await asyncio.to_thread(self._cache_file.read_bytes)
        except FileNotFoundError:
            return False
        config = pb.FleetConfig()
        try:
            config.ParseFromString(data)
        except Exception as exc:
            logger.warning("ignoring unreadable config cache {}: {}", self._cache_file, exc)
            return False
        logger.info("serving the cached fleet config version {}", config.version)
        await self._apply(config, save=False)
        return True

    async def _apply(self, config: pb.FleetConfig, *, save: bool) -> None:
        if self.config is not None and config.version < self.config.version:
            logger.warning(
                "ignoring fleet config version {} older than {}",
                config.version,
                self.config.version,
            )
            return
        self.config = config
        await self._on_fleet(config)
        if save:
            await asyncio.to_thread(self._save, config.SerializeToString())

    def _save(self, data: bytes) -> None:
        self._cache_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self._cache_file.with_suffix(".tmp")
        temporary.write_bytes(data)
        os.replace(temporary, self._cache_file)  # never a half-written cache

    # ------------------------------------------------------------ authorization

    async def authorize(
        self, node_id: str, token: str, certificate_identity: str
    ) -> pb.AuthorizeNodeResponse:
        conn = self._conn
        if conn is None or not self.connected.is_set():
            raise ControlPlaneUnavailable(
                "the control-plane is unreachable: new registrations are refused until it returns"
            )
        request = pb.AuthorizeNodeRequest(
            node_id=node_id, token=token, certificate_identity=certificate_identity
        )
        future: asyncio.Future[pb.AuthorizeNodeResponse] = (
            asyncio.get_running_loop().create_future()
        )
        envelope = conn.envelope(request)  # its id is registered before any answer can arrive
        self._pending[envelope.message_id] = future
        try:
            await conn.send_envelope(envelope)
            async with asyncio.timeout(self._authorize_timeout_s):
                return await future
        except (ConnectionClosed, TimeoutError) as exc:
            raise ControlPlaneUnavailable(f"the control-plane did not answer: {exc}") from None
        finally:
            self._pending.pop(envelope.message_id, None)

    # ------------------------------------------------------------ node status

    def report_nodes(self, report: pb.NodeStatusReport) -> None:
        """Tell the control-plane which nodes are connected (``node list``), without
        holding up the caller (a node's registration) on the control link.

        Reports are coalesced: while one send waits, later reports only replace what
        it will send, so a storm of reconnecting nodes costs a few reports, not one
        full list per node.
        """
        self._node_report = report
        conn = self._conn
        if conn is None or not self.connected.is_set() or not self._takes_reports():
            return
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.get_running_loop().create_task(self._send_report(conn))

    def _takes_reports(self) -> bool:
        """An older control-plane would close the link on a report it does not know."""
        return self.config is not None and self.config.accepts_node_status

    async def _send_report(self, conn: Connection) -> None:
        await asyncio.sleep(REPORT_COALESCE_S)
        with contextlib.suppress(ConnectionClosed, ConnectionError):
            await conn.send(self._node_report)  # the latest by the time it is written

    # ------------------------------------------------------------ connection

    async def run(self) -> None:
        """Connect, follow pushes, reconnect with jittered backoff; until cancelled."""
        delay = 0.2
        while True:
            if await self._connect_and_follow():
                delay = 0.2
            pause = delay * random.uniform(0.5, 1.5)
            logger.info("reconnecting to the control-plane in {:.1f}s", pause)
            await asyncio.sleep(pause)
            delay = min(delay * 2, self._reconnect_max_s)

    async def _connect_and_follow(self) -> bool:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._server_name if self._tls else None,
                ),
                10,
            )
        except ssl.SSLCertVerificationError as exc:
            # A configuration error, but the edge goes on: it serves its cached config
            # and its nodes meanwhile, and keeps trying in case the certificate is fixed.
            mismatch = await rejection(
                exc,
                host=self._host,
                port=self._port,
                server_name=self._server_name,
                settings=self._tls_files,
                peer="control-plane",
                setting="control_plane",
                timeout_s=10,
            )
            logger.error("control-plane at {}:{}: {}", self._host, self._port, mismatch)
            return False
        except (OSError, TimeoutError) as exc:
            if self._tls is not None and peer_closed_during_handshake(exc):
                logger.warning("control-plane at {}:{}: {}", self._host, self._port, PEER_CLOSED)
            else:
                logger.warning(
                    "control-plane at {}:{} unreachable: {}", self._host, self._port, exc
                )
            return False
        conn = Connection(
            reader, writer, sender_id=self._edge_id, heartbeat_interval=self._heartbeat_interval_s
        )
        followed = False
        try:
            async with conn:
                known = self.config.version if self.config else 0
                await conn.send(
                    pb.EdgeHello(
                        edge_id=self._edge_id, version=self._version, known_config_version=known
                    )
                )
                first = await asyncio.wait_for(conn.receive(), 10)
                if first.WhichOneof("body") != "fleet_config":
                    raise UnexpectedMessage(
                        f"expected fleet_config, got {first.WhichOneof('body')}"
                    )
                await self._apply(first.fleet_config, save=True)
                self._conn = conn
                self.connected.set()
                if self._on_link is not None:
                    self._on_link(True)
                followed = True
                logger.info("connected to the control-plane (config version {})", self.version)
                if self._takes_reports():
                    await conn.send(self._node_report)
                async for envelope in conn:
                    await self._handle(envelope)
                reason = conn.peer_error.message if conn.peer_error else "closed by its side"
                logger.warning("control-plane connection lost: {}", reason)
        except ProtocolError as exc:
            logger.warning("control-plane connection closed: {}", exc)
        except (ConnectionClosed, ConnectionError, TimeoutError) as exc:
            logger.warning("control-plane connection lost: {}", exc or type(exc).__name__)
        finally:
            self._conn = None
            self.connected.clear()
            await cancel_and_wait(self._report_task)  # the next link sends the latest
            self._report_task = None
            if self._on_link is not None and followed:
                self._on_link(False)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionClosed("control-plane connection lost"))
            with contextlib.suppress(Exception):
                await conn.close()
        return followed

    async def _handle(self, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "fleet_config":
            await self._apply(envelope.fleet_config, save=True)
            logger.info("fleet config version {} pushed", envelope.fleet_config.version)
        elif kind == "authorize_node_response":
            future = self._pending.get(envelope.correlation_id)
            if future is not None and not future.done():
                future.set_result(envelope.authorize_node_response)
        elif kind == "error":
            logger.warning("control-plane reported: {}", envelope.error.message)
        else:
            raise UnexpectedMessage(f"an edge does not accept {kind} from the control-plane")

    @property
    def version(self) -> int:
        return self.config.version if self.config else 0
