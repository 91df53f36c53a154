"""The SQLite credential store against real database files: hashes in, plaintext never."""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from iop_control_plane.adapters.sqlite_store import SCHEMA_VERSION, SqliteCredentialStore
from iop_control_plane.domain.credentials import (
    API_KEY_PREFIX,
    NODE_TOKEN_PREFIX,
    new_api_key,
    new_node_token,
)
from iop_control_plane.domain.nodes import NodeState
from iop_control_plane.errors import CredentialError
from iop_control_plane.ports import CredentialStore

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "credentials.db"  # the parent does not exist yet


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteCredentialStore]:
    opened = await SqliteCredentialStore.open(db_path)
    try:
        yield opened
    finally:
        await opened.aclose()


def _permissions(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _create_database(path: Path, user_version: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = sqlite3.connect(path)
    try:
        raw.execute(f"PRAGMA user_version = {user_version:d}")
    finally:
        raw.close()


def _raw_bytes(db_path: Path) -> bytes:
    """Everything SQLite has written: the database and, while open, its WAL and index."""
    files = [db_path, *(db_path.with_name(db_path.name + s) for s in ("-wal", "-shm"))]
    return b"".join(f.read_bytes() for f in files if f.exists())


async def test_open_creates_the_schema_in_wal_mode(
    store: SqliteCredentialStore, db_path: Path
) -> None:
    port: CredentialStore = store  # mypy checks that the adapter satisfies the port
    assert port is store
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        names = {row[0] for row in raw.execute("SELECT name FROM sqlite_master")}
    finally:
        raw.close()
    assert {"node_tokens", "api_keys", "node_tokens_secret_hash", "api_keys_secret_hash"} <= names
    assert _permissions(db_path) == 0o600  # hashes only, but still nobody else's business


async def test_a_newer_schema_is_refused(db_path: Path) -> None:
    _create_database(db_path, user_version=SCHEMA_VERSION + 1)
    with pytest.raises(CredentialError, match="newer"):
        await SqliteCredentialStore.open(db_path)


async def test_the_files_hold_hashes_never_plaintext(
    store: SqliteCredentialStore, db_path: Path
) -> None:
    token = new_node_token("gpu-1", NOW)
    key = new_api_key("team-a", ["llama3"], 2, NOW)
    await store.add_node_token(token.token)
    await store.add_api_key(key.key)
    await store.revoke_api_key(key.key.key_id, NOW)

    while_open = _raw_bytes(db_path)  # the rows sit in the WAL until a checkpoint
    await store.aclose()
    after_close = _raw_bytes(db_path)  # closing checkpoints them into the main file

    for raw in (while_open, after_close):
        for prefix, plaintext, digest in (
            (NODE_TOKEN_PREFIX, token.plaintext, token.token.secret_hash),
            (API_KEY_PREFIX, key.plaintext, key.key.secret_hash),
        ):
            assert plaintext.encode() not in raw
            assert plaintext.removeprefix(prefix).encode() not in raw  # not even unprefixed
            assert digest.encode() in raw  # and we did look at the right bytes


V1_API_KEYS = """CREATE TABLE api_keys (
    key_id TEXT PRIMARY KEY, name TEXT NOT NULL, secret_hash TEXT NOT NULL,
    models TEXT NOT NULL, max_concurrent INTEGER NOT NULL CHECK (max_concurrent >= 0),
    created_at TEXT NOT NULL, revoked_at TEXT)"""
V1_NODE_TOKENS = """CREATE TABLE node_tokens (
    token_id TEXT PRIMARY KEY, node_id TEXT NOT NULL, secret_hash TEXT NOT NULL,
    created_at TEXT NOT NULL, revoked_at TEXT)"""


async def test_a_version_1_database_is_migrated_its_keys_ordinary_ones(db_path: Path) -> None:
    _create_database(db_path, 1)
    raw = sqlite3.connect(db_path)
    try:
        raw.execute(V1_API_KEYS)
        raw.execute(V1_NODE_TOKENS)
        raw.execute(
            "INSERT INTO api_keys VALUES ('key_old', 'old', 'h', '[]', 0, ?, NULL)",
            (NOW.isoformat(timespec="microseconds"),),
        )
        raw.commit()
    finally:
        raw.close()

    store = await SqliteCredentialStore.open(db_path)
    try:
        [old] = await store.list_api_keys()
        assert (old.key_id, old.operator) == ("key_old", False)
        issued = new_api_key("ops", (), 0, NOW, operator=True)
        await store.add_api_key(issued.key)
        assert await store.find_api_key(issued.key.secret_hash) == issued.key
    finally:
        await store.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
    finally:
        raw.close()


async def test_a_version_2_database_gains_the_node_tables(db_path: Path) -> None:
    """Retirements and reported states (``node retire``/``node list``) on an old file."""
    _create_database(db_path, 2)
    raw = sqlite3.connect(db_path)
    try:
        raw.execute(V1_API_KEYS)
        raw.execute("ALTER TABLE api_keys ADD COLUMN operator INTEGER NOT NULL DEFAULT 0")
        raw.execute(V1_NODE_TOKENS)
        raw.commit()
    finally:
        raw.close()
    store = await SqliteCredentialStore.open(db_path)
    try:
        assert await store.retired_nodes() == {}
        assert await store.retire_node("node-c", NOW) == NOW
        later = NOW.replace(year=NOW.year + 1)
        assert await store.retire_node("node-c", later) == NOW  # the first time is kept
        assert await store.retired_nodes() == {"node-c": NOW}
        assert await store.unretire_node("node-c")
        assert not await store.unretire_node("node-c")
        state = NodeState("node-c", "edge", True, "tok_1", NOW, "10.0.0.3:5000", "", NOW)
        await store.record_node_states([state])
        assert await store.node_states() == {"node-c": state}
        await store.edge_lost("edge", later)
        [lost] = (await store.node_states()).values()
        assert (lost.connected, lost.since) == (False, later)
        assert "edge edge lost its control link" in lost.detail
    finally:
        await store.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        raw.close()


async def test_a_version_4_database_gains_expiry_and_rotation(db_path: Path) -> None:
    """Keys and tokens from before expiry existed never expire and were never rotated."""
    _create_database(db_path, 4)
    raw = sqlite3.connect(db_path)
    try:
        raw.execute(V1_API_KEYS)
        for column in (
            "operator INTEGER NOT NULL DEFAULT 0",
            "limits TEXT NOT NULL DEFAULT '{}'",
            "weight INTEGER NOT NULL DEFAULT 1",
            "priority INTEGER NOT NULL DEFAULT 0",
        ):
            raw.execute(f"ALTER TABLE api_keys ADD COLUMN {column}")
        raw.execute(V1_NODE_TOKENS)
        raw.execute(
            "INSERT INTO api_keys (key_id, name, secret_hash, models, max_concurrent,"
            " created_at) VALUES ('key_old', 'old', 'h', '[]', 0, ?)",
            (NOW.isoformat(timespec="microseconds"),),
        )
        raw.commit()
    finally:
        raw.close()
    store = await SqliteCredentialStore.open(db_path)
    try:
        [old] = await store.list_api_keys()
        assert (old.key_id, old.expires_at, old.rotation) == ("key_old", None, None)
        assert await store.find_api_key("h") == old
    finally:
        await store.aclose()
