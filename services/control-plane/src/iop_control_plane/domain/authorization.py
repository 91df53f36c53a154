"""Whether a node may join the fleet: the control-plane's one authorization rule.

Pure so it can be tested exhaustively: the caller looks the token up and passes
the current fleet. The certificate identity is checked before the token so a
stolen token is useless without the node's own certificate, and the order of
checks never tells a caller more than the first failing reason.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from iop_control_plane.domain.credentials import NodeToken, accepts, secret_expiry
from iop_control_plane.domain.fleet import FleetSpec, NodeSpec


class Refusal(StrEnum):
    """Why a registration was refused; values are metric labels."""

    MALFORMED = "malformed_request"
    IDENTITY_MISMATCH = "identity_mismatch"
    UNKNOWN_TOKEN = "unknown_token"
    REVOKED = "token_revoked"
    EXPIRED = "token_expired"
    OTHER_NODE = "token_of_another_node"
    UNKNOWN_NODE = "node_not_in_fleet"
    RETIRED = "node_retired"
    STORE_UNAVAILABLE = "storage_unavailable"  # the shared store is down: retry later


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one registration: accepted with the node's config, or why not."""

    node: NodeSpec | None
    token_id: str = ""
    refusal: Refusal | None = None
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return self.refusal is None


def authorize(
    node_id: str,
    certificate_identity: str,
    token: NodeToken | None,
    fleet: FleetSpec,
    retired: Set[str] = frozenset(),
    *,
    presented_hash: str | None = None,
    now: datetime | None = None,
) -> Decision:
    """Decide a registration of ``node_id`` presenting ``token`` over a certificate.

    A retired node is refused as retired, whatever its token (``node retire`` revoked
    them): ``node add`` admits it again. The certificate already proved which node it is.
    ``presented_hash`` (the hash of the secret presented: the token's own, or its previous
    one during a rotation's overlap) is checked for expiry at ``now``; without it, the
    token's own secret is.
    """
    if not node_id or not certificate_identity:
        return _refuse(Refusal.MALFORMED, "node id and certificate identity are required")
    if certificate_identity != node_id:
        return _refuse(
            Refusal.IDENTITY_MISMATCH,
            f"certificate identity {certificate_identity!r} does not match node id {node_id!r}",
        )
    if node_id in retired:
        # Before the token: retiring revoked its tokens, and "revoked" would hide why.
        return _refuse(
            Refusal.RETIRED,
            f"node {node_id!r} is retired (`iop-control-plane node retire`): "
            f"`iop-control-plane node add {node_id}` on the control-plane's host admits it "
            "again, with a new token",
        )
    if token is None:
        return _refuse(Refusal.UNKNOWN_TOKEN, f"the token presented by {node_id!r} is not known")
    if token.revoked:
        return _refuse(Refusal.REVOKED, f"token {token.token_id} was revoked")
    presented = token.secret_hash if presented_hash is None else presented_hash
    moment = datetime.now(UTC) if now is None else now
    if not accepts(token, presented, moment):
        ended = secret_expiry(token, presented)
        which = "its previous secret" if presented != token.secret_hash else "it"
        return _refuse(
            Refusal.EXPIRED,
            f"token {token.token_id} expired ({which} was accepted until "
            f"{ended.isoformat() if ended else '?'}): issue or rotate a new one",
        )
    if token.node_id != node_id:
        return _refuse(
            Refusal.OTHER_NODE,
            f"token {token.token_id} was issued for node {token.node_id!r}, not {node_id!r}",
        )
    node = fleet.node(node_id)
    if node is None:
        return _refuse(Refusal.UNKNOWN_NODE, f"node {node_id!r} is not in the fleet configuration")
    return Decision(node=node, token_id=token.token_id)


def _refuse(refusal: Refusal, reason: str) -> Decision:
    return Decision(node=None, refusal=refusal, reason=reason)
