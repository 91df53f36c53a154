"""The listener nodes dial: registration, snapshots, run events, config updates.

A node is admitted only when its certificate identity equals the node id it
registers as and the control-plane vouches for its token. Its providers are
routable while its connection lives; when the connection drops or goes silent
(the heartbeat watchdog aborts it: no TLS teardown to wait for) they are
unavailable at once and its runs end with an error.

A refused peer is told only ``REFUSED``; why goes to the edge's log (and its
counter). A registration of neither role (``PEER_ROLE_NODE``, ``PEER_ROLE_WORKER``) is
refused before any credential is read, and told so: that is the protocol, no secret.
A retired node is told that it is retired: its certificate proved which node it is,
and its operator, reading its log, is who must act. What a registered peer sends
about runs, providers and leases is checked by ``PeerGuard`` (one rule for every message
type).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Set
from typing import Protocol

from loguru import logger

from iop_edge.adapters.node_status import NodeStatusBook
from iop_edge.adapters.peer_guard import UNKNOWN_ROLE, PeerGuard
from iop_edge.adapters.run_wire import provider_reports, run_event, run_request
from iop_edge.adapters.worker_session import WorkerSession
from iop_edge.domain.events import RunOrder
from iop_edge.errors import ControlPlaneUnavailable
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import BatchLeases
from iop_edge.service.registry import ProviderRegistry
from iop_proto.accept import StreamServer
from iop_proto.connection import Connection, error_body
from iop_proto.errors import ConnectionClosed, ProtocolError, UnexpectedMessage
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.tls import TlsRefused
from iop_proto.v1 import runtime_pb2 as pb

REFUSED = "registration refused (the edge's log says why)"
"""All a refused peer learns: which node a token belongs to, or whether the
control-plane is up, is for the operator, not for whoever holds a certificate."""
RETIRED = "node_retired"  # the control-plane's reason code for a retired node


class Authorizer(Protocol):
    """What registration needs from the control-plane client."""

    async def authorize(
        self, node_id: str, token: str, certificate_identity: str
    ) -> pb.AuthorizeNodeResponse: ...


class NodeConnection:
    """A registered node, as dispatch sees it (implements ``NodeLink``)."""

    def __init__(
        self,
        node_id: str,
        conn: Connection,
        token_id: str,
        config: pb.NodeConfig,
        acknowledges_runs: bool = False,
        follows_edges: bool = False,
    ) -> None:
        self.node_id = node_id
        self.acknowledges_runs = acknowledges_runs
        self.follows_edges = follows_edges
        self.conn = conn
        self.token_id = token_id
        self.config = config
        self._configured = {provider.id for provider in config.providers}

    @property
    def configured(self) -> Set[str]:
        """Every provider the edge configured this connection with: one moved to another
        node since may still appear in a snapshot sent before the node heard."""
        return self._configured

    def configure(self, config: pb.NodeConfig) -> None:
        self.config = config
        self._configured.update(provider.id for provider in config.providers)

    async def send_run(self, order: RunOrder) -> None:
        """Returns once the order is on its way: a small one queued for this pass's
        write, a large one written and its transport drained (``Connection.send``). Its
        node's acknowledgement is timed from then (``RequestRun.order_sent``)."""
        # Deferred: the runs dispatched in one event-loop pass leave in one TLS write (a
        # cancel sent later takes them along first, so the node never sees it before them).
        await self.conn.send(run_request(order), correlation_id=order.run_id, defer=True)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        await self.conn.send(pb.CancelRequest(run_id=run_id, reason=reason), correlation_id=run_id)


class NodeServer:
    """Accepts node connections over mTLS and keeps the registry's pool in step: a
    registered connection is the registry's node link until it drops. A run event goes
    to its run (the dispatcher's, found by the peer guard, which checks it is this
    connection's)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        edge_id: str,
        registry: ProviderRegistry,
        authorizer: Authorizer,
        guard: PeerGuard,
        metrics: EdgeMetrics,
        tls: ssl.SSLContext | None,
        heartbeat_interval_s: float,
        max_frame_size: int,
        register_timeout_s: float,
        handshake_timeout_s: float,
        node_roles: tuple[str, ...] = ("node",),
        worker_roles: tuple[str, ...] = ("worker",),
        batches: BatchLeases | None = None,
        status: NodeStatusBook | None = None,
    ) -> None:
        self._host, self.port = host, port
        self.status = status or NodeStatusBook()
        self._edge_id = edge_id
        self._registry = registry
        self._authorizer = authorizer
        self._guard = guard
        self._metrics = metrics
        self._tls = tls
        self._heartbeat_interval_s = heartbeat_interval_s
        self._max_frame_size = max_frame_size
        self._node_roles = node_roles
        self._worker_roles = worker_roles
        self._batches = batches
        self._register_timeout_s = register_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self.workers: dict[str, set[WorkerSession]] = {}  # live connections by worker id
        self._edges: list[pb.EdgeEndpoint] = []  # the fleet's edges, told to peers that follow
        self._following_workers: set[Connection] = set()
        self._server: StreamServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        # The handshake is the server's, its failures come back here to be named and counted.
        self._server = StreamServer(
            self._handle,
            self._tls,
            self._tls_refused,
            handshake_timeout_s=self._handshake_timeout_s,
        )
        self.port = await self._server.start(self._host, self.port)
        logger.info("listening for nodes on {}:{}", self._host, self.port)
        return self.port

    def stop_accepting(self) -> None:
        """The edge is draining: no new peer connects (refused by the OS, the listener is
        closed), while the connections that carry runs in flight stay."""
        if self._server is not None:
            self._server.close()
            logger.info("no longer accepting nodes on {}:{}", self._host, self.port)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        going = error_body(pb.ERROR_CODE_SHUTTING_DOWN, "edge is stopping")
        await asyncio.gather(
            *(node.conn.close(going) for node in self._nodes()), return_exceptions=True
        )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------ config pushes

    async def apply_fleet(self, config: pb.FleetConfig) -> None:
        """Push changed node configs; drop retired nodes and those admitted with a now
        revoked token; tell the peers that follow the edges a changed list of them."""
        revoked = set(config.revoked_token_ids)
        retired = set(config.retired_node_ids)
        configs = {node.node_id: node for node in config.nodes}
        edges = list(config.edges)
        edges_changed = edges != self._edges
        self._edges = edges
        # The configs first, every node's, then the disconnects (which wait): the caller
        # applied the fleet to the pool just before, so requests that waited for a slot
        # are about to be sent with the new fleet's served names; each node's new config
        # is written to its link before any of them (a frame written first arrives first).
        leaving = [n for n in self._nodes() if n.node_id in retired or n.token_id in revoked]
        for node in self._nodes():
            if node.node_id in retired or node.token_id in revoked:
                continue
            new = configs.get(node.node_id, pb.NodeConfig(node_id=node.node_id))
            tell_edges = edges_changed and node.follows_edges
            if new != node.config or tell_edges:
                node.configure(new)
                update = pb.RegisterResponse(accepted=True, node_config=new, edge_id=self._edge_id)
                if node.follows_edges:
                    update.edges.extend(edges)
                try:
                    await node.conn.send(update)
                except ConnectionClosed:
                    continue
        for node in leaving:
            if node.node_id in retired:
                logger.warning("node {}: retired, disconnecting it", node.node_id)
                await node.conn.close(error_body(pb.ERROR_CODE_UNAUTHENTICATED, "node retired"))
            else:
                logger.warning("node {}: its token {} was revoked", node.node_id, node.token_id)
                await node.conn.close(error_body(pb.ERROR_CODE_UNAUTHENTICATED, "token revoked"))
        if edges_changed:
            update = pb.RegisterResponse(accepted=True, edge_id=self._edge_id, edges=edges)
            for conn in list(self._following_workers):
                with contextlib.suppress(ConnectionClosed):
                    await conn.send(update)

    # ------------------------------------------------------------ connections

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = Connection(
            reader,
            writer,
            sender_id=self._edge_id,
            max_frame_size=self._max_frame_size,
            heartbeat_interval=self._heartbeat_interval_s,
        )
        node: NodeConnection | None = None
        reason = "connection closed"
        try:
            node = await self._register(conn)
            if node is not None:
                conn.start_heartbeats()
                await self._follow(node)
        except ProtocolError as exc:
            reason = str(exc)
            await conn.abort(exc)
        except TimeoutError:
            reason = "no register_request in time"
            await conn.abort(UnexpectedMessage(reason))
        except (ConnectionClosed, ConnectionError) as exc:
            reason = str(exc) or type(exc).__name__
        except Exception:
            # The per-connection boundary: one node's failure never reaches the others.
            logger.exception("node connection {} failed", conn.peer_name)
            reason = "internal error"
            await conn.close(error_body(pb.ERROR_CODE_INTERNAL, reason))
        finally:
            await conn.close()
            if node is not None:
                self._registry.node_disconnected(node, reason)
                if self._registry.links.get(node.node_id) is None:  # else a new one replaced it
                    self.status.disconnected(node.node_id, node.token_id, reason)
                logger.warning("node {} disconnected: {}", node.node_id, reason)
            self._tasks.discard(task)

    async def _register(self, conn: Connection) -> NodeConnection | None:
        first = await asyncio.wait_for(conn.receive(), self._register_timeout_s)
        if first.WhichOneof("body") != "register_request":
            raise UnexpectedMessage(f"expected register_request, got {first.WhichOneof('body')}")
        request = first.register_request
        if request.role == pb.PEER_ROLE_WORKER:
            await self._serve_worker(conn, first)
            return None
        if request.role != pb.PEER_ROLE_NODE:
            await self._refuse_role(conn, first)
            return None
        identity = conn.peer.name if conn.peer else request.peer_id  # plaintext: no identity
        role = conn.peer.role if conn.peer else "node"
        refusal, code = None, ""
        if self._tls is not None and role not in self._node_roles:
            refusal = (
                f"certificate role (OU) {role!r} may not register as a node (allowed: "
                f"{', '.join(self._node_roles)}): issue its certificate with that role "
                f"(devcerts --identity {identity}:node)"
            )
            code = "wrong_role"
        elif identity != request.peer_id:
            refusal = (
                f"certificate identity {identity!r} does not match node id {request.peer_id!r}"
            )
            code = "identity_mismatch"
        answer: pb.AuthorizeNodeResponse | None = None
        if refusal is None:
            try:
                answer = await self._authorizer.authorize(request.peer_id, request.token, identity)
            except ControlPlaneUnavailable as exc:
                refusal, code = exc.message, "control_plane_unavailable"
            else:
                if not answer.accepted:
                    refusal, code = answer.reason, answer.reason_code or "refused"
        if refusal is not None or answer is None:
            self._metrics.registrations.labels("refused").inc()
            self._refuse("node", code, _who(request, identity), refusal or "refused")
            told = refusal if code == RETIRED and conn.peer is not None and refusal else REFUSED
            await conn.send(
                pb.RegisterResponse(accepted=False, reason=told),
                correlation_id=first.message_id,
            )
            await conn.close()
            return None
        node = NodeConnection(
            request.peer_id,
            conn,
            answer.token_id,
            answer.node_config,
            request.acknowledges_runs,
            request.follows_edges,
        )
        previous = self._registry.links.get(node.node_id)
        if isinstance(previous, NodeConnection):
            await previous.conn.close(
                error_body(pb.ERROR_CODE_UNEXPECTED_MESSAGE, "replaced by a new connection")
            )
        await conn.send(
            pb.RegisterResponse(
                accepted=True,
                node_config=answer.node_config,
                heartbeat_interval_ms=int(self._heartbeat_interval_s * 1000),
                edge_id=self._edge_id,
                takes_folded_completions=True,
                takes_provider_load=True,
                edges=self._edges if request.follows_edges else (),
            ),
            correlation_id=first.message_id,
        )
        self._registry.node_connected(node, provider_reports(request.providers))
        self.status.connected(node.node_id, node.token_id, conn.peer_address)
        self._metrics.registrations.labels("accepted").inc()
        logger.info(
            "node {} registered ({} providers)", node.node_id, len(answer.node_config.providers)
        )
        return node

    async def _refuse_role(self, conn: Connection, first: pb.Envelope) -> None:
        """A role that is neither a node's nor a worker's (unset, or a number this edge
        does not know): refused before any credential is looked at, so the peer may be
        told why (it learns nothing about tokens or certificates), and only this
        connection is closed."""
        request = first.register_request
        identity = conn.peer.name if conn.peer else request.peer_id
        role = pb.PeerRole.Name(request.role) if request.role in _ROLES else str(request.role)
        told = f"unknown peer role {role}: a peer registers as PEER_ROLE_NODE or PEER_ROLE_WORKER"
        self._metrics.registrations.labels("refused").inc()
        self._refuse(UNKNOWN_ROLE, "unknown_role", _who(request, identity), told)
        await conn.send(
            pb.RegisterResponse(accepted=False, reason=told), correlation_id=first.message_id
        )
        await conn.close()

    def _nodes(self) -> list[NodeConnection]:
        """The registered connections (the registry's links are this server's)."""
        return [link for link in self._registry.links.values() if isinstance(link, NodeConnection)]

    def _tls_refused(self, exc: TlsRefused, peer: object) -> None:
        self._guard.refuse("tls", UNKNOWN_ROLE, exc.reason, peer, exc.detail)

    def _refuse(self, role: str, reason: str, who: str, detail: str) -> None:
        """A registration refused: the details for the log (never a token), not the peer."""
        self._guard.refuse("registration", role, reason, who, detail)

    async def _serve_worker(self, conn: Connection, first: pb.Envelope) -> None:
        """Workers need no token: their certificate role is their credential."""
        request = first.register_request
        identity = conn.peer.name if conn.peer else request.peer_id
        role = conn.peer.role if conn.peer else "worker"
        refusal, code = None, ""
        if self._batches is None:
            refusal, code = "this edge runs no batch jobs", "no_batches"
        elif self._tls is not None and role not in self._worker_roles:
            refusal = (
                f"certificate role (OU) {role!r} may not register as a worker (allowed: "
                f"{', '.join(self._worker_roles)}): issue its certificate with that role "
                f"(devcerts --identity {identity}:worker)"
            )
            code = "wrong_role"
        elif identity != request.peer_id:
            refusal = (
                f"certificate identity {identity!r} does not match worker id {request.peer_id!r}"
            )
            code = "identity_mismatch"
        if refusal is not None or self._batches is None:
            self._refuse("worker", code, _who(request, identity), str(refusal))
            await conn.send(
                pb.RegisterResponse(accepted=False, reason=REFUSED),
                correlation_id=first.message_id,
            )
            return
        await conn.send(
            pb.RegisterResponse(
                accepted=True,
                heartbeat_interval_ms=int(self._heartbeat_interval_s * 1000),
                edge_id=self._edge_id,
                edges=self._edges if request.follows_edges else (),
            ),
            correlation_id=first.message_id,
        )
        conn.start_heartbeats()
        worker_id = request.peer_id
        live = self.workers.setdefault(worker_id, set())
        if live:
            # The same certificate twice: a worker dialling back before its old link is
            # known dead, or someone holding its key. Either way the live connection keeps
            # its leases (freed when it ends) and this one gets only new ones.
            logger.warning(
                "worker {}: a second connection registered from {} while {} of it live; "
                "each keeps only the leases granted on it",
                worker_id,
                conn.peer_address,
                len(live),
            )
        else:
            await self._free_leases(self._batches.worker_registered(worker_id))
        session = WorkerSession(worker_id, conn, self._batches, self._guard)
        live.add(session)
        if request.follows_edges:
            self._following_workers.add(conn)
        logger.info("worker {} registered", worker_id)
        try:
            await session.serve()
        finally:
            self._following_workers.discard(conn)
            live.discard(session)
            if not live and self.workers.get(worker_id) is live:
                del self.workers[worker_id]
            logger.info("worker {} disconnected", worker_id)
            task = asyncio.current_task()
            # Not when the edge stops (the task is cancelled): the next start frees them.
            if session.leases and not (task and task.cancelling()):
                await self._free_leases(
                    self._batches.connection_ended(worker_id, list(session.leases))
                )

    @staticmethod
    async def _free_leases(freeing: Awaitable[None]) -> None:
        """Free a worker's leases early; with the shared store down they are left to
        expire (their TTL), and the worker is served meanwhile."""
        try:
            await freeing
        except StoreDown as exc:
            logger.warning("leases left to expire: {}", exc)

    async def _follow(self, node: NodeConnection) -> None:
        registry, guard, conn = self._registry, self._guard, node.conn
        while True:
            try:
                envelope = await conn.receive()
            except ConnectionClosed:
                return  # the node closed the link cleanly; protocol faults still raise
            kind = envelope.WhichOneof("body")
            if kind == "run_event":
                event = envelope.run_event
                run = guard.run_event(node, event)  # NotYours for another connection's run
                if run is not None:  # else ended here already: dropped
                    converted = run_event(event)
                    if converted is not None:
                        run.deliver(converted)
            elif kind == "provider_snapshot":
                snapshot = envelope.provider_snapshot
                guard.snapshot(node, snapshot)
                registry.apply_snapshot(node.node_id, provider_reports(snapshot.providers))
            elif kind == "error":
                logger.warning("node {} reported: {}", node.node_id, envelope.error.message)
            else:
                raise UnexpectedMessage(f"an edge does not accept {kind} from a node")


_ROLES = frozenset(pb.PeerRole.values())


def _who(request: pb.RegisterRequest, identity: str) -> str:
    """A registration's peer for the log: the id it asked for and its certificate's name."""
    asked = request.peer_id or "?"
    return asked if identity == asked else f"{asked} (certificate {identity!r})"
