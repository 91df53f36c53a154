"""The control-plane's ports: what the domain and entrypoints need from the outside world."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from iop_control_plane.domain.controls import Control, ControlChange
from iop_control_plane.domain.credentials import ApiKey, NodeToken, Rotation
from iop_control_plane.domain.nodes import NodeState


class CredentialStore(Protocol):
    """Durable node tokens and API keys, shared by the running server and the admin CLI.

    Only records are stored (hashes, never plaintext). Lookups return revoked
    records too, so a caller can tell "revoked" from "never existed" in its logs;
    deciding to refuse a revoked credential is the caller's job. Several
    processes may use one store at once: the CLI writes while the server reads,
    which is why ``change_marker`` exists.
    """

    async def add_node_token(self, token: NodeToken) -> None:
        """Keep ``token``; raises ``CredentialError`` if its id or hash is already stored."""
        ...

    async def find_node_token(self, secret_hash: str) -> NodeToken | None:
        """The token whose secret, or previous secret of a rotation, hashes to
        ``secret_hash``, revoked or expired or not, or ``None``."""
        ...

    async def list_node_tokens(self) -> list[NodeToken]:
        """Every token, revoked ones included, oldest first."""
        ...

    async def revoke_node_token(self, token_id: str, now: datetime) -> NodeToken:
        """Revoke a token and return it; ``CredentialError`` if the id is unknown.

        Revoking twice is not an error and keeps the first revocation time, so a
        retried command is harmless and the audit trail keeps the real moment.
        """
        ...

    async def add_api_key(self, key: ApiKey) -> None:
        """Keep ``key``; raises ``CredentialError`` if its id or hash is already stored."""
        ...

    async def find_api_key(self, secret_hash: str) -> ApiKey | None:
        """The key whose secret, or previous secret of a rotation, hashes to
        ``secret_hash``, revoked or expired or not, or ``None``."""
        ...

    async def list_api_keys(self) -> list[ApiKey]:
        """Every key, revoked ones included, oldest first."""
        ...

    async def revoke_api_key(self, key_id: str, now: datetime) -> ApiKey:
        """Revoke a key and return it; ``CredentialError`` if the id is unknown.

        As with tokens, a second revocation keeps the first time.
        """
        ...

    async def update_api_key(self, key: ApiKey) -> ApiKey:
        """Store ``key``'s policy (models, max_concurrent, limits, weight, priority) over the
        stored key of its id and return what is stored; ``CredentialError`` if the id is
        unknown or the key revoked (a revoked key stays as it was when revoked)."""
        ...

    async def rotate_node_token(
        self, token_id: str, secret_hash: str, rotation: Rotation
    ) -> NodeToken:
        """Give the token the secret hashing to ``secret_hash`` and keep ``rotation`` (its
        previous secret and the end of the overlap); return what is stored.

        Only over ``rotation.previous_hash`` and only if not revoked: ``CredentialError``
        otherwise (a rotation raced by another, or a revocation), so no previous secret
        stays valid that its rotator was not told about."""
        ...

    async def rotate_api_key(self, key_id: str, secret_hash: str, rotation: Rotation) -> ApiKey:
        """As ``rotate_node_token``, for an API key: same id, same policy, a new secret."""
        ...

    async def change_marker(self) -> int:
        """A number that differs once anyone, in any process, has committed a change.

        Cheap enough to poll every second: the server compares it with the last
        value it saw and reloads its token and key tables only when it moved.
        Only comparable between calls on the same store instance; it may also
        move without a visible change (that costs one needless reload, no more).
        """
        ...

    async def retire_node(self, node_id: str, now: datetime) -> datetime:
        """Retire ``node_id`` (see ``domain.nodes``); a repeat keeps the first time."""
        ...

    async def unretire_node(self, node_id: str) -> bool:
        """Admit a retired node again; whether it was retired."""
        ...

    async def retired_nodes(self) -> dict[str, datetime]:
        """Every retired node and when it was retired."""
        ...

    async def record_node_states(self, states: list[NodeState]) -> None:
        """Keep the latest state an edge reported of each of these nodes."""
        ...

    async def node_states(self) -> dict[str, NodeState]:
        """The last reported state of every node an edge ever reported."""
        ...

    async def edge_lost(self, edge_id: str, now: datetime) -> None:
        """The edge's link ended: the nodes it reported connected are no longer known."""
        ...

    async def runtime_controls(self) -> list[Control]:
        """The runtime controls in force (docs/ARCHITECTURE.md#runtime-control)."""
        ...

    async def control_audit(self, limit: int, change_id: str = "") -> list[ControlChange]:
        """The latest ``limit`` changes of runtime controls, newest first (only the one
        ``change_id`` names, when given)."""
        ...

    async def record_control_change(self, change: ControlChange) -> bool:
        """Put ``change.applied()`` in force for ``(change.kind, change.target)`` and add
        ``change`` to the audit trail, together, and count it as a change
        (``change_marker``); only while the control in force there is ``change.before``
        (""  none): False, and nothing stored, when another change came first."""
        ...


class OpenedCredentialStore(CredentialStore, Protocol):
    """A store the composition root or the CLI opened, and closes when done."""

    async def aclose(self) -> None:
        """Release the file or the pool; idempotent."""
        ...
