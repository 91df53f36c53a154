"""The fleet authority: the running configuration, credentials, and who must hear of changes.

Everything an edge can learn from the control-plane comes from one immutable
snapshot (``pb.FleetConfig``), rebuilt only when the fleet file, a key or a
revocation actually changed; its version then moves forward. A refused fleet
file never replaces the running one.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from loguru import logger

from iop_control_plane.adapters.controls_proto import bake_controls, controls_to_proto
from iop_control_plane.adapters.fleet_file import load_fleet_file
from iop_control_plane.adapters.fleet_proto import (
    EXPIRED_LISTED_S,
    expired_keys_to_proto,
    key_expiry_to_proto,
    limits_to_proto,
    models_to_proto,
    node_config_to_proto,
)
from iop_control_plane.domain.authorization import Decision, Refusal, authorize
from iop_control_plane.domain.controls import Control, provider_controls
from iop_control_plane.domain.credentials import ApiKey, NodeToken, accepts, hash_secret
from iop_control_plane.domain.fleet import FleetSpec, NodeSpec, ParsedFleet
from iop_control_plane.domain.nodes import NodeState
from iop_control_plane.errors import FleetConfigError
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.ports import CredentialStore
from iop_proto.postgres import StorageUnavailable
from iop_proto.v1 import runtime_pb2 as pb

ChangeListener = Callable[[pb.FleetConfig], Awaitable[None]]


class FleetAuthority:
    """Owns the served fleet snapshot; the edge server asks it and listens to it."""

    def __init__(
        self,
        fleet_file: Path,
        store: CredentialStore,
        metrics: ControlPlaneMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fleet_file = fleet_file
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._fleet: ParsedFleet | None = None
        self._api_keys: list[pb.ApiKeyPolicy] = []
        self._expired_keys: list[pb.ExpiredKey] = []
        self._keys_required = False  # a key is stored, live or not: FleetConfig.keys_required
        self._revoked_token_ids: list[str] = []
        self._retired: frozenset[str] = frozenset()
        self._controls: list[Control] = []  # runtime controls in force (entrypoints.controls)
        self._store_marker: int | None = None
        self._next_expiry_s = float("inf")  # the next key expiry or overlap end (unix s)
        self._snapshot = pb.FleetConfig()
        self._digest = b""
        self._listeners: set[ChangeListener] = set()
        # edge id -> (its session, where its nodes reach it): the edges listed to peers
        self._edges: dict[str, tuple[object, pb.EdgeEndpoint]] = {}

    # ------------------------------------------------------------ state

    @property
    def fleet(self) -> FleetSpec:
        if self._fleet is None:
            raise RuntimeError("the fleet authority has not started")
        return self._fleet.spec

    @property
    def snapshot(self) -> pb.FleetConfig:
        """The configuration edges receive; never mutated after it is built."""
        return self._snapshot

    @property
    def retired(self) -> frozenset[str]:
        """Nodes retired by ``node retire``: left out of the snapshot, refused at registration."""
        return self._retired

    @property
    def version(self) -> int:
        return self._snapshot.version

    async def start(self) -> None:
        """Load the fleet file and the credentials; a bad file stops the start."""
        self._fleet = load_fleet_file(self._fleet_file)
        for warning in self._fleet.warnings:
            logger.warning("{}: {}", self._fleet_file, warning)
        await self._load_credentials()
        self._rebuild()
        logger.info(
            "fleet {} loaded: {} models, {} nodes, version {}",
            self._fleet_file,
            len(self.fleet.models),
            len(self.fleet.nodes),
            self.version,
        )

    # ------------------------------------------------------------ changes

    def subscribe(self, listener: ChangeListener) -> None:
        self._listeners.add(listener)

    def unsubscribe(self, listener: ChangeListener) -> None:
        self._listeners.discard(listener)

    async def reload_fleet(self) -> list[str]:
        """Re-read the fleet file; returns the problems when it was refused."""
        try:
            parsed = load_fleet_file(self._fleet_file)
        except FleetConfigError as exc:
            self._metrics.reloads.labels(result="refused").inc()
            for problem in exc.problems:
                logger.error("fleet reload refused, keeping version {}: {}", self.version, problem)
            return exc.problems
        for warning in parsed.warnings:
            logger.warning("{}: {}", self._fleet_file, warning)
        self._fleet = parsed
        changed = self._rebuild()
        self._metrics.reloads.labels(result="applied" if changed else "unchanged").inc()
        logger.info(
            "fleet reload {}: version {}", "applied" if changed else "unchanged", self.version
        )
        if changed:
            await self._notify()
        return []

    async def refresh_credentials(self) -> bool:
        """Pick up token and key changes (made by the CLI); push them when they matter.

        Also when a key's expiry (or a rotation's overlap) has passed: the expired key
        leaves the pushed configuration then, for edges from before the expiry field.
        """
        marker = await self._store.change_marker()
        if marker == self._store_marker and not self._clock() >= self._next_expiry_s:
            return False
        await self._load_credentials(marker)
        if not self._rebuild():
            return False
        logger.info("credentials changed: version {}", self.version)
        await self._notify()
        return True

    async def _load_credentials(self, marker: int | None = None) -> None:
        """Read tokens, keys and retirements; nothing is replaced unless all were read,
        so a store lost halfway leaves the old tables and the old marker (retried)."""
        if marker is None:
            marker = await self._store.change_marker()
        now = datetime.fromtimestamp(self._clock(), UTC)
        stored = await self._store.list_api_keys()
        # An expired key leaves api_keys at its moment (an edge from before the expiry
        # field then stops taking it at the next push) and is listed as expired instead.
        keys = [
            (key, *key_expiry_to_proto(key, now))
            for key in stored
            if not key.revoked and accepts(key, key.secret_hash, now)
        ]
        expired_keys = expired_keys_to_proto(stored, now)
        api_keys = [
            pb.ApiKeyPolicy(
                key_id=key.key_id,
                name=key.name,
                key_hash=key.secret_hash,
                models=list(key.models),
                max_concurrent=key.max_concurrent,
                operator=key.operator,
                limits=None if key.limits.unlimited else limits_to_proto(key.limits),
                model_limits=[
                    pb.ModelKeyLimits(model=model, limits=limits_to_proto(entry))
                    for model, entry in key.model_limits
                ],
                weight=key.weight,
                priority=key.priority,
                expires_unix_ms=expires_ms,
                previous_key_hash=previous_hash,
                previous_expires_unix_ms=previous_ms,
            )
            for key, expires_ms, previous_hash, previous_ms in keys
        ]
        ends = [ms for _, key_ms, _, old_ms in keys for ms in (key_ms, old_ms) if ms]
        ends += [e.expired_unix_ms + EXPIRED_LISTED_S * 1000 for e in expired_keys]
        tokens = await self._store.list_node_tokens()
        revoked_token_ids = sorted(token.token_id for token in tokens if token.revoked)
        retired = frozenset(await self._store.retired_nodes())
        controls = await self._store.runtime_controls()
        self._show_expiries(stored, tokens)
        self._store_marker = marker
        self._next_expiry_s = min(ends) / 1000 if ends else float("inf")
        self._api_keys = api_keys
        self._expired_keys = expired_keys
        # Revoked and long-expired keys stay in the store: once one was issued, the edges
        # require keys for good, whatever is live.
        self._keys_required = bool(stored)
        self._revoked_token_ids = revoked_token_ids
        self._retired = retired
        self._controls = controls

    def _show_expiries(self, keys: list[ApiKey], tokens: list[NodeToken]) -> None:
        """``iop_credential_expiry_timestamp_seconds`` for every credential that expires
        and is not revoked (expired ones too: an alert sees what has lapsed)."""
        gauge = self._metrics.credential_expiry
        gauge.clear()
        for kind, records in (("api_key", keys), ("node_token", tokens)):
            for record in records:
                if record.expires_at is not None and not record.revoked:
                    record_id = record.key_id if isinstance(record, ApiKey) else record.token_id
                    gauge.labels(kind=kind, id=record_id).set(record.expires_at.timestamp())

    def _rebuild(self) -> bool:
        """Rebuild the snapshot; the version moves only when the content changed."""
        retired = self._retired
        gone = {p.id for n in self.fleet.nodes if n.id in retired for p in n.providers}
        content = pb.FleetConfig(
            models=models_to_proto(self.fleet, without=gone),
            nodes=[self._node_config(node) for node in self.fleet.nodes if node.id not in retired],
            api_keys=self._api_keys,
            revoked_token_ids=self._revoked_token_ids,
            retired_node_ids=sorted(retired),
            accepts_node_status=True,
            edges=[endpoint for _, (_, endpoint) in sorted(self._edges.items())],
            expired_keys=self._expired_keys,
            keys_required=self._keys_required,
            runtime_controls=controls_to_proto(self._controls),
        )
        digest = hashlib.sha256(content.SerializeToString(deterministic=True)).digest()
        if digest == self._digest:
            return False
        # Wall-clock milliseconds keep versions increasing across restarts without storage.
        content.version = max(self._snapshot.version + 1, int(self._clock() * 1000))
        self._digest = digest
        self._snapshot = content
        self._metrics.config_version.set(content.version)
        return True

    def _node_config(self, node: NodeSpec) -> pb.NodeConfig:
        """A node's config with the runtime controls of its providers baked in."""
        return bake_controls(node_config_to_proto(node), provider_controls(self._controls))

    @property
    def controls(self) -> list[Control]:
        return self._controls

    async def controls_changed(self, controls: list[Control]) -> None:
        """A runtime control was stored (``entrypoints.controls``): push it now, not at
        the next poll, so every edge has it within the second."""
        self._controls = controls
        if self._rebuild():
            logger.info("runtime controls changed: version {}", self.version)
            await self._notify()

    async def _notify(self) -> None:
        """Push to every listener at once, so one slow edge does not delay the rest."""
        snapshot = self._snapshot
        results = await asyncio.gather(
            *(listener(snapshot) for listener in list(self._listeners)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, Exception):
                logger.opt(exception=result).warning("a config push failed")

    # ------------------------------------------------------------ authorization

    async def authorize(self, request: pb.AuthorizeNodeRequest) -> Decision:
        """Decide a node registration an edge forwards, and count the outcome.

        With the shared store down, the node is refused as "retry later" rather than
        the edge's link failing: the edge keeps its session and its config.
        """
        try:
            token = (
                await self._store.find_node_token(hash_secret(request.token))
                if request.token
                else None
            )
        except StorageUnavailable as exc:
            logger.warning("node {}: {}", request.node_id or "?", exc)
            decision = Decision(
                node=None,
                refusal=Refusal.STORE_UNAVAILABLE,
                reason="the control-plane's store is unreachable; retry later",
            )
        else:
            decision = authorize(
                request.node_id,
                request.certificate_identity,
                token,
                self.fleet,
                self._retired,
                presented_hash=hash_secret(request.token),
                now=datetime.fromtimestamp(self._clock(), UTC),
            )
        reason = decision.refusal.value if decision.refusal else "accepted"
        self._metrics.authorizations.labels(
            result="accepted" if decision.accepted else "refused", reason=reason
        ).inc()
        if decision.accepted:
            logger.info("node {} authorized (token {})", request.node_id, decision.token_id)
        else:
            logger.warning("node {} refused: {}", request.node_id or "?", decision.reason)
        return decision

    async def record_node_status(self, edge_id: str, report: pb.NodeStatusReport) -> None:
        """Keep what an edge reports of its node connections, for ``node list``.

        Lost while the shared store is down: an edge sends its whole report again on
        its next change and on each reconnect, and the link matters more than the list.
        """
        now = datetime.now(UTC)
        states = [
            NodeState(
                node_id=status.node_id,
                edge_id=edge_id,
                connected=status.connected,
                token_id=status.token_id,
                since=datetime.fromtimestamp(status.since_unix_ms / 1000, UTC)
                if status.since_unix_ms
                else None,
                peer_address=status.peer_address,
                detail=status.detail,
                reported_at=now,
            )
            for status in report.nodes
        ]
        try:
            await self._store.record_node_states(states)
        except StorageUnavailable as exc:
            logger.warning("node states of edge {} not recorded: {}", edge_id, exc)

    async def edge_joined(self, session: object, edge_id: str, endpoint: pb.EdgeEndpoint) -> None:
        """An edge linked up and said where its nodes reach it: every edge lists it to its
        nodes and workers from now on (docs/ARCHITECTURE.md#several-edges)."""
        self._edges[edge_id] = (
            session,
            pb.EdgeEndpoint(
                edge_id=edge_id,
                host=endpoint.host,
                port=endpoint.port,
                server_name=endpoint.server_name,
            ),
        )
        if self._rebuild():
            logger.info("edge {} listed at {}:{}", edge_id, endpoint.host, endpoint.port)
            await self._notify()

    async def edge_lost(self, edge_id: str, session: object | None = None) -> None:
        """The edge's link ended: what it reported as connected is no longer known, and it
        is listed no more (unless a newer link of it, ``session`` not its, is up)."""
        listed = self._edges.get(edge_id)
        if listed is not None and (session is None or listed[0] is session):
            del self._edges[edge_id]
            if self._rebuild():
                logger.info("edge {} no longer listed", edge_id)
                await self._notify()
        try:
            await self._store.edge_lost(edge_id, datetime.now(UTC))
        except StorageUnavailable as exc:
            logger.warning("edge {} lost; its nodes' states not updated: {}", edge_id, exc)

    def authorization_response(self, decision: Decision) -> pb.AuthorizeNodeResponse:
        if decision.node is None:
            code = decision.refusal.value if decision.refusal else ""
            return pb.AuthorizeNodeResponse(
                accepted=False, reason=decision.reason, reason_code=code
            )
        return pb.AuthorizeNodeResponse(
            accepted=True,
            node_config=self._node_config(decision.node),
            token_id=decision.token_id,
        )
