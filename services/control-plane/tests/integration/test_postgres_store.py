"""What only the PostgreSQL credential store has: a migration ledger shared by every
control-plane, data files that never see a plaintext, and an outage as one retryable
error it recovers from (the contract itself is test_store_contract.py, on both backends)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest
from pydantic import SecretStr

from iop_control_plane.adapters.postgres_store import COMPONENT, STEPS, PostgresCredentialStore
from iop_control_plane.domain.credentials import (
    API_KEY_PREFIX,
    NODE_TOKEN_PREFIX,
    new_api_key,
    new_node_token,
)
from iop_control_plane.errors import CredentialError
from iop_proto.postgres import PostgresSettings, StorageUnavailable
from iop_proto.testing_postgres import PostgresServer

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _settings(dsn: str, connect_timeout_s: float = 5.0) -> PostgresSettings:
    return PostgresSettings(dsn=SecretStr(dsn), connect_timeout_s=connect_timeout_s)


async def test_control_planes_starting_together_migrate_once(postgres_dsn: str) -> None:
    stores = await asyncio.gather(
        *(PostgresCredentialStore.open(_settings(postgres_dsn)) for _ in range(3))
    )
    try:
        issued = new_api_key("team-a", [], 0, NOW)
        await stores[0].add_api_key(issued.key)
        assert [await s.find_api_key(issued.key.secret_hash) for s in stores] == [issued.key] * 3
        connection = await asyncpg.connect(postgres_dsn)
        try:
            version = await connection.fetchval(
                "SELECT version FROM iop_schema_versions WHERE component = $1", COMPONENT
            )
            tables = await connection.fetchval(
                "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'cp\\_%'"
            )
        finally:
            await connection.close()
        assert version == len(STEPS)
        # tokens, keys, retirements, node states, the version row, controls and their audit
        assert tables == 7
    finally:
        for store in stores:
            await store.aclose()


async def test_a_store_of_a_newer_release_is_refused(postgres_dsn: str) -> None:
    store = await PostgresCredentialStore.open(_settings(postgres_dsn))
    await store.aclose()
    connection = await asyncpg.connect(postgres_dsn)
    try:
        await connection.execute(
            "UPDATE iop_schema_versions SET version = $1 WHERE component = $2",
            len(STEPS) + 1,
            COMPONENT,
        )
    finally:
        await connection.close()
    with pytest.raises(CredentialError, match="newer"):
        await PostgresCredentialStore.open(_settings(postgres_dsn))


async def test_the_data_files_hold_hashes_never_plaintext(
    postgres_server: PostgresServer,
) -> None:
    """What test_sqlite_store checks of the SQLite file, here of the cluster's own files:
    the database's tables and the write-ahead log, written out by a checkpoint."""
    dsn = postgres_server.create_database()
    store = await PostgresCredentialStore.open(_settings(dsn))
    token = new_node_token("gpu-1", NOW)
    key = new_api_key("team-a", ["llama3"], 2, NOW)
    try:
        await store.add_node_token(token.token)
        await store.add_api_key(key.key)
        await store.revoke_api_key(key.key.key_id, NOW)
    finally:
        await store.aclose()
    connection = await asyncpg.connect(dsn)
    try:
        oid = await connection.fetchval(
            "SELECT oid FROM pg_database WHERE datname = current_database()"
        )
        await connection.execute("CHECKPOINT")  # the rows leave shared memory for the files
    finally:
        await connection.close()
    data = postgres_server.data
    files = [*(data / "base" / str(oid)).iterdir(), *(data / "pg_wal").glob("0*")]
    raw = b"".join(path.read_bytes() for path in files if path.is_file())
    for prefix, plaintext, digest in (
        (NODE_TOKEN_PREFIX, token.plaintext, token.token.secret_hash),
        (API_KEY_PREFIX, key.plaintext, key.key.secret_hash),
    ):
        assert plaintext.encode() not in raw
        assert plaintext.removeprefix(prefix).encode() not in raw  # not even unprefixed
        assert digest.encode() in raw  # and we did look at the right bytes


async def test_an_outage_is_storage_unavailable_and_the_store_recovers(
    postgres_server: PostgresServer,
) -> None:
    store = await PostgresCredentialStore.open(
        _settings(postgres_server.create_database(), connect_timeout_s=2)
    )
    try:
        issued = new_node_token("gpu-1", NOW)
        await store.add_node_token(issued.token)
        marker = await store.change_marker()
        postgres_server.down()
        try:
            with pytest.raises(StorageUnavailable, match="reading the change marker"):
                await store.change_marker()
            with pytest.raises(StorageUnavailable, match="finding a node token"):
                await store.find_node_token(issued.token.secret_hash)
            with pytest.raises(StorageUnavailable, match="storing an API key"):
                await store.add_api_key(new_api_key("team-a", [], 0, NOW).key)
        finally:
            postgres_server.up()
        # The same pool reconnects: what was committed before is there, nothing else.
        assert await store.change_marker() == marker
        assert await store.find_node_token(issued.token.secret_hash) == issued.token
        assert await store.list_api_keys() == []
    finally:
        await store.aclose()
