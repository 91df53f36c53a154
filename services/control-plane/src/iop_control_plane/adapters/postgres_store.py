"""The credential store on PostgreSQL: one store for every control-plane of a fleet.

Same records and rules as the SQLite store (hashes, never a plaintext; a repeat
revocation keeps the first time), so a second control-plane on another host sees
every token and key the first one's CLI issued and can take over.

How a change reaches every running control-plane: a version row, polled
(``change_marker``), not LISTEN/NOTIFY. Row-level triggers on the tables that make
the served configuration (tokens, keys, retirements) bump ``cp_changes.version`` in
the writer's own transaction, so the version moves exactly when a committed row
changed, whoever wrote it (this CLI, another host's CLI, an operator's psql). Each
server already polls its store every ``credentials_poll_s`` for the SQLite file's
sake; here that is one primary-key read. A notification would be lost while a
listener's connection is down (a PostgreSQL restart, a network cut) and then needs
exactly this version check to catch up, so polling alone is the simpler, complete
mechanism; it also needs no dedicated connection per process.

Every call turns an unreachable server into ``StorageUnavailable`` (``reachable``);
the running server keeps its last configuration meanwhile (see ``authority``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg

from iop_control_plane.adapters.postgres_controls import PostgresControls
from iop_control_plane.domain.controls import Control, ControlChange
from iop_control_plane.domain.credentials import (
    ApiKey,
    NodeToken,
    Rotation,
    as_utc,
    updated_key,
)
from iop_control_plane.domain.key_limits import dump_limits, load_limits
from iop_control_plane.domain.nodes import NodeState
from iop_control_plane.errors import CredentialError
from iop_proto.postgres import PostgresSettings, apply_migrations, open_pool, reachable

COMPONENT = "control-plane"
"""The name under which ``iop_schema_versions`` keeps this schema's version."""

# Ids sort bytewise (COLLATE "C"), as SQLite's do, whatever the cluster's locale.
STEPS: tuple[str, ...] = (
    """
    CREATE TABLE cp_node_tokens (
        token_id    TEXT COLLATE "C" PRIMARY KEY,
        node_id     TEXT COLLATE "C" NOT NULL,
        secret_hash TEXT NOT NULL UNIQUE,
        created_at  TIMESTAMPTZ NOT NULL,
        revoked_at  TIMESTAMPTZ
    );
    CREATE TABLE cp_api_keys (
        key_id         TEXT COLLATE "C" PRIMARY KEY,
        name           TEXT NOT NULL,
        secret_hash    TEXT NOT NULL UNIQUE,
        models         TEXT[] NOT NULL,
        max_concurrent INTEGER NOT NULL CHECK (max_concurrent >= 0),
        created_at     TIMESTAMPTZ NOT NULL,
        revoked_at     TIMESTAMPTZ,
        operator       BOOLEAN NOT NULL DEFAULT FALSE
    );
    CREATE TABLE cp_retired_nodes (
        node_id    TEXT COLLATE "C" PRIMARY KEY,
        retired_at TIMESTAMPTZ NOT NULL
    );
    CREATE TABLE cp_node_states (
        node_id      TEXT COLLATE "C" PRIMARY KEY,
        edge_id      TEXT NOT NULL,
        connected    BOOLEAN NOT NULL,
        token_id     TEXT NOT NULL,
        since        TIMESTAMPTZ,
        peer_address TEXT NOT NULL,
        detail       TEXT NOT NULL,
        reported_at  TIMESTAMPTZ NOT NULL
    );
    CREATE INDEX cp_node_states_edge ON cp_node_states (edge_id) WHERE connected;
    CREATE TABLE cp_changes (
        only_row BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (only_row),
        version  BIGINT NOT NULL
    );
    INSERT INTO cp_changes (only_row, version) VALUES (TRUE, 0);
    CREATE FUNCTION cp_changed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE cp_changes SET version = version + 1;
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER cp_node_tokens_changed AFTER INSERT OR UPDATE OR DELETE ON cp_node_tokens
        FOR EACH ROW EXECUTE FUNCTION cp_changed();
    CREATE TRIGGER cp_api_keys_changed AFTER INSERT OR UPDATE OR DELETE ON cp_api_keys
        FOR EACH ROW EXECUTE FUNCTION cp_changed();
    CREATE TRIGGER cp_retired_nodes_changed AFTER INSERT OR UPDATE OR DELETE ON cp_retired_nodes
        FOR EACH ROW EXECUTE FUNCTION cp_changed();
    """,
    # 2: limits per key (domain.key_limits, the same JSON text as the SQLite store's),
    # weight and priority
    """
    ALTER TABLE cp_api_keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE cp_api_keys ADD COLUMN weight INTEGER NOT NULL DEFAULT 1 CHECK (weight >= 1);
    ALTER TABLE cp_api_keys ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
    """,
    # 3: expiry and rotation with an overlap (the previous secret, accepted until
    # previous_until); every credential before never expires and was never rotated
    """
    ALTER TABLE cp_node_tokens ADD COLUMN expires_at TIMESTAMPTZ;
    ALTER TABLE cp_node_tokens ADD COLUMN previous_hash TEXT;
    ALTER TABLE cp_node_tokens ADD COLUMN previous_until TIMESTAMPTZ;
    CREATE INDEX cp_node_tokens_previous_hash ON cp_node_tokens (previous_hash);
    ALTER TABLE cp_api_keys ADD COLUMN expires_at TIMESTAMPTZ;
    ALTER TABLE cp_api_keys ADD COLUMN previous_hash TEXT;
    ALTER TABLE cp_api_keys ADD COLUMN previous_until TIMESTAMPTZ;
    CREATE INDEX cp_api_keys_previous_hash ON cp_api_keys (previous_hash);
    """,
    # 4: runtime controls in force (a change moves the marker, so every control-plane
    # pushes it) and their audit trail (domain.controls)
    """
    CREATE TABLE cp_runtime_controls (
        kind       TEXT COLLATE "C" NOT NULL,
        target     TEXT COLLATE "C" NOT NULL,
        value      TEXT NOT NULL,
        change_id  TEXT NOT NULL,
        changed_by TEXT NOT NULL,
        changed_at TIMESTAMPTZ NOT NULL,
        reason     TEXT NOT NULL,
        PRIMARY KEY (kind, target)
    );
    CREATE TABLE cp_runtime_control_audit (
        change_id    TEXT COLLATE "C" PRIMARY KEY,
        at           TIMESTAMPTZ NOT NULL,
        changed_by   TEXT NOT NULL,
        kind         TEXT NOT NULL,
        target       TEXT NOT NULL,
        before_value TEXT NOT NULL,
        after_value  TEXT NOT NULL,
        reason       TEXT NOT NULL,
        reverts      TEXT NOT NULL
    );
    CREATE INDEX cp_runtime_control_audit_at ON cp_runtime_control_audit (at);
    CREATE TRIGGER cp_runtime_controls_changed
        AFTER INSERT OR UPDATE OR DELETE ON cp_runtime_controls
        FOR EACH ROW EXECUTE FUNCTION cp_changed();
    """,
)
"""The schema, one SQL script per version (``apply_migrations``); append, never edit.

The triggers are row-level on purpose: a statement that changed no row (a repeated
revocation) fires none, so the marker does not move for it. ``cp_node_states`` has
none: edges' reports are not part of the pushed configuration."""

_EXPIRY_COLUMNS = "expires_at, previous_hash, previous_until"
_TOKEN_COLUMNS = f"token_id, node_id, secret_hash, created_at, revoked_at, {_EXPIRY_COLUMNS}"
_KEY_COLUMNS = (
    "key_id, name, secret_hash, models, max_concurrent, created_at, revoked_at, operator,"
    f" limits, weight, priority, {_EXPIRY_COLUMNS}"
)
_TABLES = {"node_tokens": ("cp_node_tokens", "token_id"), "api_keys": ("cp_api_keys", "key_id")}


def _optional_utc(moment: datetime | None) -> datetime | None:
    return None if moment is None else as_utc(moment)


def _rotation(row: asyncpg.Record) -> Rotation | None:
    if row["previous_hash"] is None:
        return None
    return Rotation(previous_hash=row["previous_hash"], until=row["previous_until"])


def _expiry_values(record: NodeToken | ApiKey) -> tuple[Any, ...]:
    rotation = record.rotation
    return (
        _optional_utc(record.expires_at),
        None if rotation is None else rotation.previous_hash,
        None if rotation is None else as_utc(rotation.until),
    )


def _token(row: asyncpg.Record) -> NodeToken:
    return NodeToken(
        token_id=row["token_id"],
        node_id=row["node_id"],
        secret_hash=row["secret_hash"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        expires_at=row["expires_at"],
        rotation=_rotation(row),
    )


def _key(row: asyncpg.Record) -> ApiKey:
    limits, model_limits = load_limits(row["limits"])
    return ApiKey(
        key_id=row["key_id"],
        name=row["name"],
        secret_hash=row["secret_hash"],
        models=tuple(row["models"]),
        max_concurrent=row["max_concurrent"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        operator=row["operator"],
        limits=limits,
        model_limits=model_limits,
        weight=row["weight"],
        priority=row["priority"],
        expires_at=row["expires_at"],
        rotation=_rotation(row),
    )


class PostgresCredentialStore:
    """A ``CredentialStore`` on a bounded asyncpg pool; make it with ``await open(settings)``."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._closed = False
        self._controls = PostgresControls(pool)

    @classmethod
    async def open(cls, settings: PostgresSettings) -> PostgresCredentialStore:
        """Open the pool and bring the schema up to date; the caller must ``aclose()`` it.

        ``StorageUnavailable`` when the server cannot be reached; ``CredentialError``
        when the store was made by a newer release (as the SQLite store says it).
        """
        pool = await open_pool(settings)
        try:
            await apply_migrations(pool, COMPONENT, STEPS)
        except RuntimeError as exc:
            await pool.close()
            raise CredentialError(f"credential store: {exc}") from None
        except BaseException:
            await pool.close()
            raise
        return cls(pool)

    async def aclose(self) -> None:
        """Close the pool; idempotent."""
        if not self._closed:
            self._closed = True
            await self._pool.close()

    async def _execute(self, what: str, sql: str, *args: Any) -> int:
        """Run one write statement; returns the number of rows it changed."""
        with reachable(what):
            try:
                status = await self._pool.execute(sql, *args)
            except asyncpg.UniqueViolationError as exc:
                # Ids are 32 random bits: a clash is rare but possible; hashes clash never.
                raise CredentialError(
                    f"credential already stored ({exc.constraint_name})"
                ) from None
        return int(status.rsplit(" ", 1)[-1])  # "INSERT 0 1", "UPDATE 2", "DELETE 0"

    async def _fetch(self, what: str, sql: str, *args: Any) -> list[asyncpg.Record]:
        with reachable(what):
            return list(await self._pool.fetch(sql, *args))

    # ------------------------------------------------------------ tokens

    async def add_node_token(self, token: NodeToken) -> None:
        await self._execute(
            "storing a node token",
            f"INSERT INTO cp_node_tokens ({_TOKEN_COLUMNS})"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            token.token_id,
            token.node_id,
            token.secret_hash,
            as_utc(token.created_at),
            _optional_utc(token.revoked_at),
            *_expiry_values(token),
        )

    async def find_node_token(self, secret_hash: str) -> NodeToken | None:
        rows = await self._fetch(
            "finding a node token",
            f"SELECT {_TOKEN_COLUMNS} FROM cp_node_tokens WHERE secret_hash = $1"
            f" UNION ALL SELECT {_TOKEN_COLUMNS} FROM cp_node_tokens WHERE previous_hash = $1"
            " LIMIT 1",
            secret_hash,
        )
        return _token(rows[0]) if rows else None

    async def list_node_tokens(self) -> list[NodeToken]:
        rows = await self._fetch(
            "listing node tokens",
            f"SELECT {_TOKEN_COLUMNS} FROM cp_node_tokens ORDER BY created_at, token_id",
        )
        return [_token(row) for row in rows]

    async def revoke_node_token(self, token_id: str, now: datetime) -> NodeToken:
        # "AND revoked_at IS NULL" keeps the first revocation time; RETURNING cannot
        # show a row it did not update, hence the read after it.
        await self._execute(
            "revoking a node token",
            "UPDATE cp_node_tokens SET revoked_at = $1 WHERE token_id = $2 AND revoked_at IS NULL",
            as_utc(now),
            token_id,
        )
        rows = await self._fetch(
            "reading a node token",
            f"SELECT {_TOKEN_COLUMNS} FROM cp_node_tokens WHERE token_id = $1",
            token_id,
        )
        if not rows:
            raise CredentialError(f"no node token with id {token_id!r}")
        return _token(rows[0])

    # ------------------------------------------------------------ keys

    async def add_api_key(self, key: ApiKey) -> None:
        await self._execute(
            "storing an API key",
            f"INSERT INTO cp_api_keys ({_KEY_COLUMNS})"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
            key.key_id,
            key.name,
            key.secret_hash,
            list(key.models),
            key.max_concurrent,
            as_utc(key.created_at),
            _optional_utc(key.revoked_at),
            key.operator,
            dump_limits(key.limits, key.model_limits),
            key.weight,
            key.priority,
            *_expiry_values(key),
        )

    async def update_api_key(self, key: ApiKey) -> ApiKey:
        await self._execute(
            "updating an API key",
            "UPDATE cp_api_keys SET models = $1, max_concurrent = $2, limits = $3, weight = $4,"
            " priority = $5 WHERE key_id = $6 AND revoked_at IS NULL",
            list(key.models),
            key.max_concurrent,
            dump_limits(key.limits, key.model_limits),
            key.weight,
            key.priority,
            key.key_id,
        )
        rows = await self._fetch(
            "reading an API key",
            f"SELECT {_KEY_COLUMNS} FROM cp_api_keys WHERE key_id = $1",
            key.key_id,
        )
        return updated_key(key, [_key(row) for row in rows])

    async def find_api_key(self, secret_hash: str) -> ApiKey | None:
        rows = await self._fetch(
            "finding an API key",
            f"SELECT {_KEY_COLUMNS} FROM cp_api_keys WHERE secret_hash = $1"
            f" UNION ALL SELECT {_KEY_COLUMNS} FROM cp_api_keys WHERE previous_hash = $1"
            " LIMIT 1",
            secret_hash,
        )
        return _key(rows[0]) if rows else None

    async def list_api_keys(self) -> list[ApiKey]:
        rows = await self._fetch(
            "listing API keys",
            f"SELECT {_KEY_COLUMNS} FROM cp_api_keys ORDER BY created_at, key_id",
        )
        return [_key(row) for row in rows]

    async def revoke_api_key(self, key_id: str, now: datetime) -> ApiKey:
        await self._execute(
            "revoking an API key",
            "UPDATE cp_api_keys SET revoked_at = $1 WHERE key_id = $2 AND revoked_at IS NULL",
            as_utc(now),
            key_id,
        )
        rows = await self._fetch(
            "reading an API key",
            f"SELECT {_KEY_COLUMNS} FROM cp_api_keys WHERE key_id = $1",
            key_id,
        )
        if not rows:
            raise CredentialError(f"no API key with id {key_id!r}")
        return _key(rows[0])

    async def rotate_node_token(
        self, token_id: str, secret_hash: str, rotation: Rotation
    ) -> NodeToken:
        return _token(await self._rotate("node_tokens", token_id, secret_hash, rotation))

    async def rotate_api_key(self, key_id: str, secret_hash: str, rotation: Rotation) -> ApiKey:
        return _key(await self._rotate("api_keys", key_id, secret_hash, rotation))

    async def _rotate(
        self, kind: str, record_id: str, secret_hash: str, rotation: Rotation
    ) -> asyncpg.Record:
        # Only over the secret the rotation was made from, as in the SQLite store; the
        # table and column names come from _TABLES, never from input.
        table, id_column = _TABLES[kind]
        columns = _TOKEN_COLUMNS if kind == "node_tokens" else _KEY_COLUMNS
        rows = await self._fetch(
            "rotating a credential",
            f"UPDATE {table} SET secret_hash = $1, previous_hash = $2, previous_until = $3"
            f" WHERE {id_column} = $4 AND secret_hash = $2 AND revoked_at IS NULL"
            f" RETURNING {columns}",
            secret_hash,
            rotation.previous_hash,
            as_utc(rotation.until),
            record_id,
        )
        if len(rows) != 1:
            raise CredentialError(f"{record_id} changed or was revoked meanwhile; try again")
        return rows[0]

    async def change_marker(self) -> int:
        """The version row the triggers bump: the same number for every control-plane."""
        with reachable("reading the change marker"):
            return int(await self._pool.fetchval("SELECT version FROM cp_changes"))

    # ------------------------------------------------------------ nodes

    async def retire_node(self, node_id: str, now: datetime) -> datetime:
        """Mark ``node_id`` retired; a repeat keeps (and returns) the first time."""
        await self._execute(
            "retiring a node",
            "INSERT INTO cp_retired_nodes (node_id, retired_at) VALUES ($1, $2)"
            " ON CONFLICT (node_id) DO NOTHING",
            node_id,
            as_utc(now),
        )
        rows = await self._fetch(
            "reading a retirement",
            "SELECT retired_at FROM cp_retired_nodes WHERE node_id = $1",
            node_id,
        )
        retired_at: datetime = rows[0]["retired_at"]
        return retired_at

    async def unretire_node(self, node_id: str) -> bool:
        """Admit ``node_id`` again (``node add``); whether it was retired."""
        deleted = await self._execute(
            "admitting a node", "DELETE FROM cp_retired_nodes WHERE node_id = $1", node_id
        )
        return deleted > 0

    async def retired_nodes(self) -> dict[str, datetime]:
        rows = await self._fetch(
            "listing retired nodes",
            "SELECT node_id, retired_at FROM cp_retired_nodes ORDER BY node_id",
        )
        return {row["node_id"]: row["retired_at"] for row in rows}

    async def record_node_states(self, states: list[NodeState]) -> None:
        """Keep the latest reported state of each node (one edge's report), in one
        statement: arrays of columns, so no bound on the parameters a report may carry.

        Not a change (no trigger): connection states are not part of the pushed config.
        """
        latest = {state.node_id: state for state in states}  # one row per node, the last
        if not latest:
            return
        rows = list(latest.values())
        await self._execute(
            "recording node states",
            "INSERT INTO cp_node_states (node_id, edge_id, connected, token_id, since,"
            " peer_address, detail, reported_at)"
            " SELECT * FROM unnest($1::text[], $2::text[], $3::bool[], $4::text[],"
            " $5::timestamptz[], $6::text[], $7::text[], $8::timestamptz[])"
            " ON CONFLICT (node_id) DO UPDATE SET edge_id = EXCLUDED.edge_id,"
            " connected = EXCLUDED.connected, token_id = EXCLUDED.token_id,"
            " since = EXCLUDED.since, peer_address = EXCLUDED.peer_address,"
            " detail = EXCLUDED.detail, reported_at = EXCLUDED.reported_at",
            [s.node_id for s in rows],
            [s.edge_id for s in rows],
            [s.connected for s in rows],
            [s.token_id for s in rows],
            [_optional_utc(s.since) for s in rows],
            [s.peer_address for s in rows],
            [s.detail for s in rows],
            [as_utc(s.reported_at) for s in rows],
        )

    async def edge_lost(self, edge_id: str, now: datetime) -> None:
        """``edge_id``'s control link ended: its connected nodes become unknown (shown
        disconnected, saying why) until it reports again."""
        await self._execute(
            "recording a lost edge",
            "UPDATE cp_node_states SET connected = FALSE, since = $1, reported_at = $1,"
            " detail = $2 WHERE edge_id = $3 AND connected",
            as_utc(now),
            f"edge {edge_id} lost its control link",
            edge_id,
        )

    async def node_states(self) -> dict[str, NodeState]:
        rows = await self._fetch(
            "listing node states", "SELECT * FROM cp_node_states ORDER BY node_id"
        )
        return {
            row["node_id"]: NodeState(
                node_id=row["node_id"],
                edge_id=row["edge_id"],
                connected=row["connected"],
                token_id=row["token_id"],
                since=row["since"],
                peer_address=row["peer_address"],
                detail=row["detail"],
                reported_at=row["reported_at"],
            )
            for row in rows
        }

    # ------------------------------------------------------------ runtime controls

    async def runtime_controls(self) -> list[Control]:
        return await self._controls.runtime_controls()

    async def control_audit(self, limit: int, change_id: str = "") -> list[ControlChange]:
        return await self._controls.control_audit(limit, change_id)

    async def record_control_change(self, change: ControlChange) -> bool:
        return await self._controls.record_control_change(change)
