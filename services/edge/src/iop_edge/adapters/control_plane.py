"""The edge's link to the control-plane: fleet config and its pushes, node authorizations.

The last good config is kept on disk, so a control-plane outage (or an edge
restart during one) does not stop serving; node registrations fail closed
while the control-plane is away, because only it can vouch for a token.

The dial, reconnect and backoff loop is ``iop_proto.dialer.Dialer``, the node's and the
worker's too; the edge's handshake is its hello, answered by the fleet config.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from iop_edge.errors import ControlPlaneUnavailable
from iop_proto.connection import Connection
from iop_proto.dialer import Dialer, DialSettings, LinkGauge
from iop_proto.errors import ConnectionClosed, UnexpectedMessage
from iop_proto.tasks import cancel_and_wait
from iop_proto.tls import TlsSettings
from iop_proto.v1 import runtime_pb2 as pb

_Answer = TypeVar("_Answer", pb.AuthorizeNodeResponse, pb.RuntimeControlResponse)
FleetListener = Callable[[pb.FleetConfig], Awaitable[None]]
REPORT_COALESCE_S = 0.2
"""How long a node status report waits for the ones right behind it (a reconnect storm)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""Bounds the TCP and TLS handshakes, and then the wait for the first fleet config."""
RECONNECT_INITIAL_S = 0.2


class ControlPlaneClient(Dialer):
    """Keeps a connection to the control-plane and the fleet config it serves.

    ``registered`` is set while a link is up (its first config applied); the
    ``link_gauge`` shows the same to Prometheus.
    """

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
        link_gauge: LinkGauge,
        tls_files: TlsSettings | None = None,
    ) -> None:
        dial = DialSettings(
            host=host,
            port=port,
            server_name=server_name,
            sender_id=edge_id,
            register_timeout_s=HANDSHAKE_TIMEOUT_S,
            initial_delay_s=RECONNECT_INITIAL_S,
            max_delay_s=reconnect_max_s,
            tls_files=tls_files,  # named when the control-plane's certificate does not fit
            peer="control-plane",
            setting="control_plane",
            # A configuration error, but the edge goes on: it serves its cached config and
            # its nodes meanwhile, and keeps trying in case the certificate is fixed.
            fatal_tls_mismatch=False,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        super().__init__(dial, tls, link_gauge)
        self._edge_id = edge_id
        self._version = version
        self._cache_file = cache_file
        self._on_fleet = on_fleet
        self._authorize_timeout_s = authorize_timeout_s
        self._conn: Connection | None = None
        # the requests awaiting their answer (an authorization, a runtime control change)
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._node_report = pb.NodeStatusReport()  # the latest, sent again on each connect
        self._report_task: asyncio.Task[None] | None = None  # at most one send pending
        self.config: pb.FleetConfig | None = None
        self.node_listener: pb.EdgeEndpoint | None = None
        """Where this edge's nodes and workers reach it, told in each hello (the
        control-plane lists it to every edge's peers); ``None``: not listed."""

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
        request = pb.AuthorizeNodeRequest(
            node_id=node_id, token=token, certificate_identity=certificate_identity
        )
        return await self._ask(
            request,
            pb.AuthorizeNodeResponse,
            "the control-plane is unreachable: new registrations are refused until it returns",
        )

    async def runtime_control(self, request: pb.RuntimeControlRequest) -> pb.RuntimeControlResponse:
        """An operator's runtime control change (or a listing), answered once the
        control-plane stored it and pushed it (docs/ARCHITECTURE.md#runtime-control)."""
        return await self._ask(
            request,
            pb.RuntimeControlResponse,
            "the control-plane is unreachable: runtime controls cannot change until it returns",
        )

    async def _ask(self, request: object, answer: type[_Answer], unreachable: str) -> _Answer:
        """Send ``request`` and wait for the answer that correlates with it."""
        conn = self._conn
        if conn is None:
            raise ControlPlaneUnavailable(unreachable)
        future: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
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
        if conn is None or not self.registered.is_set() or not self._takes_reports():
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

    async def _register(self, conn: Connection) -> str | None:
        """Our hello, answered by the fleet config: the link is up once it is applied."""
        known = self.config.version if self.config else 0
        hello = pb.EdgeHello(
            edge_id=self._edge_id, version=self._version, known_config_version=known
        )
        if self.node_listener is not None:
            hello.node_listener.CopyFrom(self.node_listener)
        await conn.send(hello)
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            first = await conn.receive()
        if first.WhichOneof("body") != "fleet_config":
            raise UnexpectedMessage(f"expected fleet_config, got {first.WhichOneof('body')}")
        # The control-plane has answered: asks may go from here on. Their answers are read
        # once the link serves, after this config is applied and cached (the registration
        # counts from then), within each ask's timeout. The edge shows this config while it
        # is applied, so an operator asking meanwhile must not be told "unreachable".
        self._conn = conn
        await self._apply(first.fleet_config, save=True)
        return f"with the control-plane (config version {self.version})"

    async def _serve(self, conn: Connection) -> None:
        """Follow the pushes and answers until the control-plane goes."""
        if self._takes_reports():
            await conn.send(self._node_report)
        async for envelope in conn:
            await self._handle(envelope)
        reason = conn.peer_error.message if conn.peer_error else "closed by its side"
        logger.warning("control-plane connection lost: {}", reason)

    async def _disconnected(self) -> None:
        self._conn = None
        await cancel_and_wait(self._report_task)  # the next link sends the latest
        self._report_task = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionClosed("control-plane connection lost"))

    async def _handle(self, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "fleet_config":
            await self._apply(envelope.fleet_config, save=True)
            logger.info("fleet config version {} pushed", envelope.fleet_config.version)
        elif kind in ("authorize_node_response", "runtime_control_response"):
            future = self._pending.get(envelope.correlation_id)
            if future is not None and not future.done():
                future.set_result(getattr(envelope, kind))
        elif kind == "error":
            logger.warning("control-plane reported: {}", envelope.error.message)
        else:
            raise UnexpectedMessage(f"an edge does not accept {kind} from the control-plane")

    @property
    def version(self) -> int:
        return self.config.version if self.config else 0
