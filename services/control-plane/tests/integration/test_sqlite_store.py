"""The SQLite credential store against real database files: hashes in, plaintext never."""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from iop_control_plane.adapters.sqlite_store import SCHEMA_VERSION, SqliteCredentialStore
from iop_control_plane.domain.credentials import (
    API_KEY_PREFIX,
    NODE_TOKEN_PREFIX,
    hash_secret,
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


async def test_issued_token_is_found_by_the_hash_of_its_plaintext(
    store: SqliteCredentialStore,
) -> None:
    issued = new_node_token("gpu-1", NOW)
    await store.add_node_token(issued.token)
    assert await store.find_node_token(hash_secret(issued.plaintext)) == issued.token
    assert await store.find_node_token(hash_secret("iopnt_wrong")) is None


async def test_issued_key_is_found_with_its_policy(store: SqliteCredentialStore) -> None:
    issued = new_api_key("team-a", ["llama3", "qwen"], 3, NOW)
    await store.add_api_key(issued.key)
    found = await store.find_api_key(hash_secret(issued.plaintext))
    assert found == issued.key
    assert found is not None
    assert found.models == ("llama3", "qwen")
    assert found.created_at.tzinfo is not None


async def test_lists_are_oldest_first_and_include_revoked(store: SqliteCredentialStore) -> None:
    later = new_node_token("gpu-2", NOW + timedelta(seconds=1)).token
    earlier = new_node_token("gpu-1", NOW).token
    await store.add_node_token(later)
    await store.add_node_token(earlier)
    await store.revoke_node_token(earlier.token_id, NOW + timedelta(minutes=1))
    listed = await store.list_node_tokens()
    assert [t.token_id for t in listed] == [earlier.token_id, later.token_id]
    assert listed[0].revoked
    assert not listed[1].revoked

    keys = [new_api_key(f"k{i}", [], 0, NOW + timedelta(seconds=i)).key for i in range(3)]
    for key in reversed(keys):
        await store.add_api_key(key)
    assert await store.list_api_keys() == keys


async def test_revoke_keeps_the_first_time_and_is_seen_by_find(
    store: SqliteCredentialStore,
) -> None:
    token = new_node_token("gpu-1", NOW)
    key = new_api_key("team-a", [], 0, NOW)
    await store.add_node_token(token.token)
    await store.add_api_key(key.key)
    first, second = NOW + timedelta(minutes=1), NOW + timedelta(minutes=2)

    assert (await store.revoke_node_token(token.token.token_id, first)).revoked_at == first
    assert (await store.revoke_node_token(token.token.token_id, second)).revoked_at == first
    found_token = await store.find_node_token(token.token.secret_hash)
    assert found_token is not None
    assert found_token.revoked_at == first

    assert (await store.revoke_api_key(key.key.key_id, first)).revoked_at == first
    assert (await store.revoke_api_key(key.key.key_id, second)).revoked_at == first
    found_key = await store.find_api_key(key.key.secret_hash)
    assert found_key is not None
    assert found_key.revoked


async def test_revoking_an_unknown_id_is_a_credential_error(
    store: SqliteCredentialStore,
) -> None:
    with pytest.raises(CredentialError, match="tok_00000000"):
        await store.revoke_node_token("tok_00000000", NOW)
    with pytest.raises(CredentialError, match="key_00000000"):
        await store.revoke_api_key("key_00000000", NOW)


async def test_a_duplicate_is_a_credential_error(store: SqliteCredentialStore) -> None:
    token = new_node_token("gpu-1", NOW).token
    await store.add_node_token(token)
    with pytest.raises(CredentialError, match="already stored"):
        await store.add_node_token(token)


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


async def test_the_change_marker_moves_when_another_connection_writes(
    store: SqliteCredentialStore, db_path: Path
) -> None:
    before = await store.change_marker()
    assert await store.change_marker() == before  # stable while nothing happens

    cli = await SqliteCredentialStore.open(db_path)  # a second process, as the CLI is
    try:
        issued = new_api_key("team-a", [], 0, NOW)
        await cli.add_api_key(issued.key)
    finally:
        await cli.aclose()

    after_insert = await store.change_marker()
    assert after_insert != before
    assert await store.find_api_key(issued.key.secret_hash) == issued.key

    other = await SqliteCredentialStore.open(db_path)
    try:
        await other.revoke_api_key(issued.key.key_id, NOW)
    finally:
        await other.aclose()
    assert await store.change_marker() != after_insert


async def test_the_change_marker_moves_on_own_writes_only_when_something_changed(
    store: SqliteCredentialStore,
) -> None:
    before = await store.change_marker()
    token = new_node_token("gpu-1", NOW).token
    await store.add_node_token(token)
    added = await store.change_marker()
    assert added != before
    await store.revoke_node_token(token.token_id, NOW)
    revoked = await store.change_marker()
    assert revoked != added
    await store.revoke_node_token(token.token_id, NOW + timedelta(minutes=1))
    assert await store.change_marker() == revoked  # a repeat changes nothing


async def test_data_survives_reopening(db_path: Path) -> None:
    first = await SqliteCredentialStore.open(db_path)
    issued = new_node_token("gpu-1", NOW)
    try:
        await first.add_node_token(issued.token)
    finally:
        await first.aclose()
    second = await SqliteCredentialStore.open(db_path)
    try:
        assert await second.list_node_tokens() == [issued.token]
    finally:
        await second.aclose()


async def test_aclose_is_idempotent(db_path: Path) -> None:
    store = await SqliteCredentialStore.open(db_path)
    await store.aclose()
    await store.aclose()


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
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
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


async def test_a_report_of_many_nodes_is_kept_whole(store: SqliteCredentialStore) -> None:
    """More nodes than one statement carries: every state is kept, the latest wins."""
    states = [NodeState(f"n{i}", "edge", True, "t", NOW, "", "", NOW) for i in range(1200)]
    await store.record_node_states(states)
    await store.record_node_states([NodeState("n7", "edge", False, "t", NOW, "", "gone", NOW)])
    kept = await store.node_states()
    assert len(kept) == 1200
    assert (kept["n7"].connected, kept["n7"].detail) == (False, "gone")
    assert kept["n1199"].connected
