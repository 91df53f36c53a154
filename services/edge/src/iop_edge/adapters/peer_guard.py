"""Ownership on the node port: a peer speaks only of what is its own.

One rule for every message a node or a worker sends about something the edge
keeps, checked here and nowhere else:

- a run's events are taken only from the connection the run was dispatched on
  (the connection object: a second connection of the same node owns nothing of
  the first's);
- provider states only for the sender's own providers (a snapshot's
  ``node_id``, when set, must be the sender's);
- lease renewals, releases and line runs only on leases the sender holds (the
  batch store keeps each lease's worker id, the connection the ids it was granted:
  a second connection of the same worker owns nothing of the first's), and lease
  requests only in its own name.

Anything else is a forgery, or a bug no less dangerous: ``NotYours`` is raised,
the connection's handler closes that connection with a ``PERMISSION_DENIED``
error frame, and the attempt is logged with the peer's certificate identity and
counted in ``iop_edge_peer_refusals_total{stage="ownership"}``. The victim's run,
provider or lease is untouched.

Claims about what the edge no longer knows are not forgeries: events of runs
that ended here already, leases that expired and were taken over or released,
providers outside the fleet, and providers this connection was configured with
before a fleet change moved them. A legitimate peer sends those in a race; they
stay ignored (or answered as before), and the connection lives. The providers of
a ``register_request`` describe the node's previous configuration (perhaps given
by another edge, before a move): foreign ones there are ignored, not refused; the
node reports only what this connection configured from then on.

Registration refusals and TLS refusals are logged and counted here as well
(``refuse``), so every refusal of the node port has one format and one counter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Protocol

from loguru import logger

from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import BatchLeases, ProviderView, RunLink, RunView
from iop_edge.service.runs import NodeLink
from iop_proto.connection import Connection
from iop_proto.errors import ProtocolError
from iop_proto.tls_explain import PEER_CLOSED_REASON
from iop_proto.v1 import runtime_pb2 as pb

OWNERSHIP = "ownership"
UNKNOWN_ROLE = "unknown"  # a TLS refusal: no certificate to tell the role


class NotYours(ProtocolError):
    """A peer named a run, provider or lease that belongs to another peer."""

    code = pb.ERROR_CODE_PERMISSION_DENIED

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NodePeer(NodeLink, Protocol):
    """A registered node connection, as the rule sees it (and dispatch sends runs on)."""

    conn: Connection

    @property
    def configured(self) -> Set[str]:
        """Every provider id the edge configured this connection with (never shrinks)."""
        ...


class WorkerPeer(Protocol):
    """A registered worker connection, as the rule sees it."""

    worker_id: str
    conn: Connection

    @property
    def leases(self) -> Set[str]:
        """The lease ids granted on this connection (and not released on it since)."""
        ...


class PeerGuard:
    """The ownership rule of the node port, which the node and worker listeners both call."""

    def __init__(
        self,
        runs: RunView,
        providers: ProviderView,
        metrics: EdgeMetrics,
        leases: BatchLeases | None,
    ) -> None:
        self._runs: Mapping[str, RunLink] = runs.runs  # the dispatcher's, as they change
        self._providers = providers
        self._metrics = metrics
        self._leases = leases

    # ------------------------------------------------------------ nodes

    def run_event(self, node: NodePeer, event: pb.RunEvent) -> RunLink | None:
        """The run an event of this connection speaks of; ``None`` for a run unknown here
        (it ended at the edge already: the event is dropped); refuse one of another
        connection's run."""
        run = self._runs.get(event.run_id)
        if run is None or run.link is node:
            return run
        raise self._not_yours(
            node.conn,
            "node",
            "foreign_run",
            f"sent a {event.WhichOneof('kind') or 'bodiless'} event for run {event.run_id}, "
            f"which was dispatched to {run.node_id} on another connection",
            f"run {event.run_id} is not this connection's",
        )

    def snapshot(self, node: NodePeer, snapshot: pb.ProviderSnapshot) -> None:
        """A snapshot speaks for its sender only, and only of the sender's providers."""
        if snapshot.node_id and snapshot.node_id != node.node_id:
            raise self._not_yours(
                node.conn,
                "node",
                "foreign_node",
                f"sent a provider snapshot in the name of node {snapshot.node_id}",
                f"this connection is not node {snapshot.node_id}'s",
            )
        self.provider_states(node, snapshot.providers)

    def provider_states(self, node: NodePeer, states: Iterable[pb.ProviderState]) -> None:
        """Refuse a state of a provider the fleet gives to another node, unless this
        connection was configured with it (a fleet change moved it: a stale report)."""
        providers = self._providers
        for state in states:
            slot = providers.slot(state.provider_id)
            if slot is None or slot.node_id == node.node_id:
                continue  # not in the fleet (ignored, never routable), or its own
            if state.provider_id in node.configured:
                continue
            raise self._not_yours(
                node.conn,
                "node",
                "foreign_provider",
                f"reported the state of provider {state.provider_id} of node {slot.node_id}",
                f"provider {state.provider_id} is not this node's",
            )

    # ------------------------------------------------------------ workers

    def lease_request(self, worker: WorkerPeer, request: pb.LeaseRequest) -> None:
        """A worker asks for leases in its own name only (an empty name is its own)."""
        if request.worker_id and request.worker_id != worker.worker_id:
            raise self._not_yours(
                worker.conn,
                "worker",
                "foreign_worker",
                f"asked for a lease in the name of worker {request.worker_id}",
                f"this connection is not worker {request.worker_id}'s",
            )

    async def lease(self, worker: WorkerPeer, lease_id: str, action: str) -> None:
        """Pass an operation on a lease granted on this connection, or on a lease no batch
        holds now (expired and taken over, or released: answered ``lease_lost`` as
        before); refuse one on another worker's lease, and one on a lease of another
        connection of the same worker: a worker's leases never outlive the connection
        they were granted on (it abandons them with it), so a second session with the
        same certificate has no business with the first one's."""
        if self._leases is None:
            return
        holder = await self._leases.lease_holder(lease_id)
        if holder is None or (holder == worker.worker_id and lease_id in worker.leases):
            return
        if holder == worker.worker_id:
            raise self._not_yours(
                worker.conn,
                "worker",
                "foreign_session",
                f"tried to {action} a lease of another connection of worker {holder}",
                "this lease was granted on another connection",
            )
        raise self._not_yours(
            worker.conn,
            "worker",
            "foreign_lease",
            f"tried to {action} a lease held by worker {holder}",  # never its id: a handle
            "this lease is another worker's",  # the close is logged: no id in it
        )

    # ------------------------------------------------------------ refusals

    def refuse(self, stage: str, role: str, reason: str, who: object, detail: str) -> None:
        """Log and count one refusal of the node port (never with a token in ``detail``)."""
        self._metrics.refusals.labels(stage, role, reason).inc()
        subject = who if role == UNKNOWN_ROLE else f"{role} {who}"
        if reason == PEER_CLOSED_REASON:  # not our refusal: the peer ended the handshake
            logger.warning("TLS handshake with {} ended: {}", subject, detail)
            return
        logger.warning("refused {} at {} ({}): {}", subject, stage, reason, detail)

    def _not_yours(
        self, conn: Connection, role: str, reason: str, detail: str, message: str
    ) -> NotYours:
        self.refuse(OWNERSHIP, role, reason, _identity(conn), f"{detail}; closing its connection")
        return NotYours(reason, f"permission denied: {message}")


def _identity(conn: Connection) -> str:
    """The peer as its certificate names it (its address where there is no TLS)."""
    peer = conn.peer
    if peer is None:
        return conn.peer_name
    return f"{peer.name} (certificate role {peer.role})"
