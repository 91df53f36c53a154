"""The credential store in one SQLite file, shared by the running server and the admin CLI.

WAL journal mode lets the server keep reading while a CLI process writes. Every
write is one statement in autocommit mode, so two coroutines sharing the
connection can never interleave inside a transaction; only the schema set-up
needs an explicit one. ``synchronous`` is FULL (SQLite's default): a
revocation that a power cut could undo is not a revocation.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

import aiosqlite

from iop_control_plane.adapters.sqlite_controls import CONTROL_TABLES, SqliteControls
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
from iop_proto.sqlite import open_database, statement_migrations

SCHEMA_VERSION = 6
"""Kept in ``PRAGMA user_version``; bump it with a migration when the tables change."""

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another process's write to finish before failing."""

_NODE_TABLES = (
    """CREATE TABLE IF NOT EXISTS retired_nodes (
        node_id    TEXT PRIMARY KEY,
        retired_at TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS node_states (
        node_id      TEXT PRIMARY KEY,
        edge_id      TEXT NOT NULL,
        connected    INTEGER NOT NULL,
        token_id     TEXT NOT NULL,
        since        TEXT,
        peer_address TEXT NOT NULL,
        detail       TEXT NOT NULL,
        reported_at  TEXT NOT NULL
    )""",
)
"""Retired nodes and the connection states edges report (``node list``)."""

_ROTATION_INDEXES = (
    "CREATE INDEX IF NOT EXISTS node_tokens_previous_hash ON node_tokens (previous_hash)",
    "CREATE INDEX IF NOT EXISTS api_keys_previous_hash ON api_keys (previous_hash)",
)
"""A rotated credential is also found by its previous secret, during the overlap."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS node_tokens (
        token_id    TEXT PRIMARY KEY,
        node_id     TEXT NOT NULL,
        secret_hash TEXT NOT NULL,
        created_at  TEXT NOT NULL,
        revoked_at  TEXT,
        expires_at     TEXT,
        previous_hash  TEXT,
        previous_until TEXT
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS node_tokens_secret_hash ON node_tokens (secret_hash)",
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id         TEXT PRIMARY KEY,
        name           TEXT NOT NULL,
        secret_hash    TEXT NOT NULL,
        models         TEXT NOT NULL,
        max_concurrent INTEGER NOT NULL CHECK (max_concurrent >= 0),
        created_at     TEXT NOT NULL,
        revoked_at     TEXT,
        operator       INTEGER NOT NULL DEFAULT 0,
        limits         TEXT NOT NULL DEFAULT '{}',
        weight         INTEGER NOT NULL DEFAULT 1 CHECK (weight >= 1),
        priority       INTEGER NOT NULL DEFAULT 0,
        expires_at     TEXT,
        previous_hash  TEXT,
        previous_until TEXT
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS api_keys_secret_hash ON api_keys (secret_hash)",
    *_NODE_TABLES,
    *_ROTATION_INDEXES,
    *CONTROL_TABLES,
)
"""The schema, statement by statement, each idempotent (it also runs after the migrations)."""

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    # version 1 -> 2: operator keys; every key issued before is an ordinary one
    1: ("ALTER TABLE api_keys ADD COLUMN operator INTEGER NOT NULL DEFAULT 0",),
    # version 2 -> 3: retired nodes and the connection states edges report (node list)
    2: _NODE_TABLES,
    # version 3 -> 4: limits per key (domain.key_limits), weight and priority
    3: (
        "ALTER TABLE api_keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE api_keys ADD COLUMN weight INTEGER NOT NULL DEFAULT 1 CHECK (weight >= 1)",
        "ALTER TABLE api_keys ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
    ),
    # version 4 -> 5: expiry and rotation with an overlap; every credential before never
    # expires and was never rotated
    4: tuple(
        f"ALTER TABLE {table} ADD COLUMN {column} TEXT"
        for table in ("node_tokens", "api_keys")
        for column in ("expires_at", "previous_hash", "previous_until")
    )
    + _ROTATION_INDEXES,
    # version 5 -> 6: runtime controls and their audit trail
    5: CONTROL_TABLES,
}
"""The statements that bring a file at version ``v`` (the key) to ``v + 1``."""

_STATE_ROWS_PER_STATEMENT = 500  # 8 values a row, well under SQLite's 32766 variables
_EXPIRY_COLUMNS = "expires_at, previous_hash, previous_until"
_TOKEN_COLUMNS = f"token_id, node_id, secret_hash, created_at, revoked_at, {_EXPIRY_COLUMNS}"
_KEY_COLUMNS = (
    "key_id, name, secret_hash, models, max_concurrent, created_at, revoked_at, operator,"
    f" limits, weight, priority, {_EXPIRY_COLUMNS}"
)


def _to_text(moment: datetime) -> str:
    # Fixed width (always microseconds, always +00:00), so text order is time order.
    return as_utc(moment).isoformat(timespec="microseconds")


def _to_optional_text(moment: datetime | None) -> str | None:
    return None if moment is None else _to_text(moment)


def _from_text(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _from_optional_text(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _rotation_from_row(row: sqlite3.Row) -> Rotation | None:
    if row["previous_hash"] is None:
        return None
    return Rotation(previous_hash=row["previous_hash"], until=_from_text(row["previous_until"]))


def _expiry_values(record: NodeToken | ApiKey) -> tuple[str | None, str | None, str | None]:
    rotation = record.rotation
    return (
        _to_optional_text(record.expires_at),
        None if rotation is None else rotation.previous_hash,
        None if rotation is None else _to_text(rotation.until),
    )


def _token_from_row(row: sqlite3.Row) -> NodeToken:
    return NodeToken(
        token_id=row["token_id"],
        node_id=row["node_id"],
        secret_hash=row["secret_hash"],
        created_at=_from_text(row["created_at"]),
        revoked_at=_from_optional_text(row["revoked_at"]),
        expires_at=_from_optional_text(row["expires_at"]),
        rotation=_rotation_from_row(row),
    )


def _key_from_row(row: sqlite3.Row) -> ApiKey:
    limits, model_limits = load_limits(row["limits"])
    return ApiKey(
        key_id=row["key_id"],
        name=row["name"],
        secret_hash=row["secret_hash"],
        models=tuple(json.loads(row["models"])),
        max_concurrent=row["max_concurrent"],
        created_at=_from_text(row["created_at"]),
        revoked_at=_from_optional_text(row["revoked_at"]),
        operator=bool(row["operator"]),
        limits=limits,
        model_limits=model_limits,
        weight=row["weight"],
        priority=row["priority"],
        expires_at=_from_optional_text(row["expires_at"]),
        rotation=_rotation_from_row(row),
    )


class SqliteCredentialStore:
    """A ``CredentialStore`` on one aiosqlite connection; make it with ``await open(path)``."""

    def __init__(self, db: aiosqlite.Connection, path: Path) -> None:
        self._db = db
        self.path = path
        # PRAGMA data_version only moves for other connections' commits; our own count here.
        self._own_writes = 0
        self._controls = SqliteControls(db)

    @classmethod
    async def open(cls, path: Path) -> SqliteCredentialStore:
        """Open (creating if needed) the database at ``path``; the caller must ``aclose()`` it.

        Autocommit (``open_database``): sqlite3's implicit BEGIN would hold write
        transactions open across awaits and block the other process.
        """
        db = await open_database(
            path,
            busy_timeout_s=BUSY_TIMEOUT_S,
            what="credential database",
            owner="control-plane",
            schema=_SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="FULL",
            error=CredentialError,
            migrate=statement_migrations(_MIGRATIONS, SCHEMA_VERSION),
        )
        db.row_factory = sqlite3.Row
        return cls(db, path)

    async def aclose(self) -> None:
        """Close the connection (checkpointing the WAL if it is the last one); idempotent."""
        await self._db.close()

    async def _write(self, sql: str, parameters: tuple[Any, ...]) -> int:
        """Run one write statement; returns the number of rows it changed."""
        try:
            async with self._db.execute(sql, parameters) as cursor:
                changed = cursor.rowcount
        except sqlite3.IntegrityError as exc:
            # Ids are 32 random bits: a clash is rare but possible; hashes clash never.
            raise CredentialError(f"credential already stored ({exc})") from None
        if changed > 0:
            self._own_writes += 1
        return changed

    async def _fetch(self, sql: str, parameters: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return list(await self._db.execute_fetchall(sql, parameters))

    async def add_node_token(self, token: NodeToken) -> None:
        await self._write(
            f"INSERT INTO node_tokens ({_TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                token.token_id,
                token.node_id,
                token.secret_hash,
                _to_text(token.created_at),
                _to_optional_text(token.revoked_at),
                *_expiry_values(token),
            ),
        )

    async def find_node_token(self, secret_hash: str) -> NodeToken | None:
        rows = await self._fetch(
            f"SELECT {_TOKEN_COLUMNS} FROM node_tokens WHERE secret_hash = ?"
            " UNION ALL"
            f" SELECT {_TOKEN_COLUMNS} FROM node_tokens WHERE previous_hash = ? LIMIT 1",
            (secret_hash, secret_hash),
        )
        return _token_from_row(rows[0]) if rows else None

    async def list_node_tokens(self) -> list[NodeToken]:
        rows = await self._fetch(
            f"SELECT {_TOKEN_COLUMNS} FROM node_tokens ORDER BY created_at, token_id"
        )
        return [_token_from_row(row) for row in rows]

    async def revoke_node_token(self, token_id: str, now: datetime) -> NodeToken:
        # "AND revoked_at IS NULL" keeps the first revocation time on a repeat.
        await self._write(
            "UPDATE node_tokens SET revoked_at = ? WHERE token_id = ? AND revoked_at IS NULL",
            (_to_text(now), token_id),
        )
        rows = await self._fetch(
            f"SELECT {_TOKEN_COLUMNS} FROM node_tokens WHERE token_id = ?", (token_id,)
        )
        if not rows:
            raise CredentialError(f"no node token with id {token_id!r}")
        return _token_from_row(rows[0])

    async def add_api_key(self, key: ApiKey) -> None:
        await self._write(
            f"INSERT INTO api_keys ({_KEY_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key.key_id,
                key.name,
                key.secret_hash,
                json.dumps(list(key.models)),
                key.max_concurrent,
                _to_text(key.created_at),
                _to_optional_text(key.revoked_at),
                int(key.operator),
                dump_limits(key.limits, key.model_limits),
                key.weight,
                key.priority,
                *_expiry_values(key),
            ),
        )

    async def find_api_key(self, secret_hash: str) -> ApiKey | None:
        rows = await self._fetch(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE secret_hash = ?"
            " UNION ALL"
            f" SELECT {_KEY_COLUMNS} FROM api_keys WHERE previous_hash = ? LIMIT 1",
            (secret_hash, secret_hash),
        )
        return _key_from_row(rows[0]) if rows else None

    async def list_api_keys(self) -> list[ApiKey]:
        rows = await self._fetch(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at, key_id")
        return [_key_from_row(row) for row in rows]

    async def revoke_api_key(self, key_id: str, now: datetime) -> ApiKey:
        await self._write(
            "UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
            (_to_text(now), key_id),
        )
        rows = await self._fetch(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        if not rows:
            raise CredentialError(f"no API key with id {key_id!r}")
        return _key_from_row(rows[0])

    async def update_api_key(self, key: ApiKey) -> ApiKey:
        await self._write(
            "UPDATE api_keys SET models = ?, max_concurrent = ?, limits = ?, weight = ?,"
            " priority = ? WHERE key_id = ? AND revoked_at IS NULL",
            (
                json.dumps(list(key.models)),
                key.max_concurrent,
                dump_limits(key.limits, key.model_limits),
                key.weight,
                key.priority,
                key.key_id,
            ),
        )
        rows = await self._fetch(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key.key_id,)
        )
        return updated_key(key, [_key_from_row(row) for row in rows])

    async def rotate_node_token(
        self, token_id: str, secret_hash: str, rotation: Rotation
    ) -> NodeToken:
        await self._rotate("node_tokens", "token_id", token_id, secret_hash, rotation)
        rows = await self._fetch(
            f"SELECT {_TOKEN_COLUMNS} FROM node_tokens WHERE token_id = ?", (token_id,)
        )
        return _token_from_row(rows[0])

    async def rotate_api_key(self, key_id: str, secret_hash: str, rotation: Rotation) -> ApiKey:
        await self._rotate("api_keys", "key_id", key_id, secret_hash, rotation)
        rows = await self._fetch(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        return _key_from_row(rows[0])

    async def _rotate(
        self, table: str, id_column: str, record_id: str, secret_hash: str, rotation: Rotation
    ) -> None:
        # Only over the secret the rotation was made from (and not revoked): two rotations
        # at once, or one racing a revocation, leave one winner and an error, never a
        # previous secret nobody was told about. Table and column names are ours, not input.
        changed = await self._write(
            f"UPDATE {table} SET secret_hash = ?, previous_hash = ?, previous_until = ?"
            f" WHERE {id_column} = ? AND secret_hash = ? AND revoked_at IS NULL",
            (
                secret_hash,
                rotation.previous_hash,
                _to_text(rotation.until),
                record_id,
                rotation.previous_hash,
            ),
        )
        if changed != 1:
            raise CredentialError(f"{record_id} changed or was revoked meanwhile; try again")

    async def change_marker(self) -> int:
        # Both terms only grow, so their sum moves whenever either does.
        rows = await self._fetch("PRAGMA data_version")
        return int(rows[0][0]) + self._own_writes

    # ------------------------------------------------------------ nodes

    async def retire_node(self, node_id: str, now: datetime) -> datetime:
        """Mark ``node_id`` retired; a repeat keeps (and returns) the first time."""
        await self._write(
            "INSERT OR IGNORE INTO retired_nodes (node_id, retired_at) VALUES (?, ?)",
            (node_id, _to_text(now)),
        )
        rows = await self._fetch(
            "SELECT retired_at FROM retired_nodes WHERE node_id = ?", (node_id,)
        )
        return _from_text(rows[0]["retired_at"])

    async def unretire_node(self, node_id: str) -> bool:
        """Admit ``node_id`` again (``node add``); whether it was retired."""
        return await self._write("DELETE FROM retired_nodes WHERE node_id = ?", (node_id,)) > 0

    async def retired_nodes(self) -> dict[str, datetime]:
        rows = await self._fetch("SELECT node_id, retired_at FROM retired_nodes ORDER BY node_id")
        return {row["node_id"]: _from_text(row["retired_at"]) for row in rows}

    async def record_node_states(self, states: list[NodeState]) -> None:
        """Keep the latest reported state of each node (one edge's report).

        Not counted as a change (``change_marker``): connection states are not part
        of the configuration the server pushes, and every report would else rebuild it.
        """
        rows = [
            (
                state.node_id,
                state.edge_id,
                int(state.connected),
                state.token_id,
                _to_optional_text(state.since),
                state.peer_address,
                state.detail,
                _to_text(state.reported_at),
            )
            for state in states
        ]
        # One statement per chunk: one transaction (one fsync) for many nodes, and still
        # nothing another coroutine's statement could fall into the middle of.
        for start in range(0, len(rows), _STATE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + _STATE_ROWS_PER_STATEMENT]
            values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            async with self._db.execute(
                "INSERT OR REPLACE INTO node_states (node_id, edge_id, connected, token_id,"
                f" since, peer_address, detail, reported_at) VALUES {values}",
                tuple(value for row in chunk for value in row),
            ):
                pass

    async def edge_lost(self, edge_id: str, now: datetime) -> None:
        """``edge_id``'s control link ended: its connected nodes become unknown (shown
        disconnected, saying why) until it reports again."""
        async with self._db.execute(
            "UPDATE node_states SET connected = 0, since = ?, reported_at = ?, detail = ?"
            " WHERE edge_id = ? AND connected = 1",
            (_to_text(now), _to_text(now), f"edge {edge_id} lost its control link", edge_id),
        ):
            pass

    async def node_states(self) -> dict[str, NodeState]:
        rows = await self._fetch("SELECT * FROM node_states ORDER BY node_id")
        return {
            row["node_id"]: NodeState(
                node_id=row["node_id"],
                edge_id=row["edge_id"],
                connected=bool(row["connected"]),
                token_id=row["token_id"],
                since=_from_optional_text(row["since"]),
                peer_address=row["peer_address"],
                detail=row["detail"],
                reported_at=_from_text(row["reported_at"]),
            )
            for row in rows
        }

    # ------------------------------------------------------------ runtime controls

    async def runtime_controls(self) -> list[Control]:
        return await self._controls.runtime_controls()

    async def control_audit(self, limit: int, change_id: str = "") -> list[ControlChange]:
        return await self._controls.control_audit(limit, change_id)

    async def record_control_change(self, change: ControlChange) -> bool:
        stored = await self._controls.record_control_change(change)
        if stored:
            self._own_writes += 1
        return stored
