"""iop_proto.postgres against a real PostgreSQL: migrations once, outages as one error."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from pydantic import SecretStr

from iop_proto.postgres import (
    PostgresSettings,
    StorageUnavailable,
    apply_migrations,
    open_pool,
    reachable,
)
from iop_proto.testing_postgres import PostgresServer

STEPS = (
    "CREATE TABLE things (id TEXT PRIMARY KEY)",
    "ALTER TABLE things ADD COLUMN size INTEGER NOT NULL DEFAULT 0",
)


def settings(dsn: str, **bounds: float) -> PostgresSettings:
    return PostgresSettings(dsn=SecretStr(dsn), **bounds)


async def test_concurrent_starts_migrate_once_and_a_later_release_adds_its_step(
    postgres_dsn: str,
) -> None:
    pools = [await open_pool(settings(postgres_dsn)) for _ in range(3)]
    try:
        reached = await asyncio.gather(*(apply_migrations(p, "things", STEPS[:1]) for p in pools))
        assert reached == [1, 1, 1]
        assert await apply_migrations(pools[0], "things", STEPS) == 2
        await pools[1].execute("INSERT INTO things (id, size) VALUES ('a', 3)")
        assert await pools[2].fetchval("SELECT size FROM things WHERE id = 'a'") == 3
        with pytest.raises(RuntimeError, match="newer than this release"):
            await apply_migrations(pools[0], "things", STEPS[:1])
    finally:
        for pool in pools:
            await pool.close()


async def test_a_failed_step_leaves_the_schema_as_it_was(postgres_dsn: str) -> None:
    pool = await open_pool(settings(postgres_dsn))
    try:
        with pytest.raises(asyncpg.exceptions.UndefinedTableError):
            await apply_migrations(pool, "broken", (STEPS[0], "ALTER TABLE missing ADD x INT"))
        assert await pool.fetchval("SELECT to_regclass('things')") is None
        assert await apply_migrations(pool, "broken", STEPS[:1]) == 1
    finally:
        await pool.close()


async def test_a_server_down_is_storage_unavailable_and_the_pool_recovers(
    postgres_server: PostgresServer,
) -> None:
    pool = await open_pool(settings(postgres_server.create_database(), connect_timeout_s=2))
    try:
        assert await pool.fetchval("SELECT 1") == 1
        postgres_server.down()
        try:
            with pytest.raises(StorageUnavailable, match="reading"):
                with reachable("reading"):
                    await pool.fetchval("SELECT 1")
        finally:
            postgres_server.up()
        with reachable("reading again"):
            assert await pool.fetchval("SELECT 2") == 2
    finally:
        await pool.close()


async def test_an_unreachable_server_fails_the_pool_with_storage_unavailable() -> None:
    closed = settings("postgresql://iop@127.0.0.1:1/none", connect_timeout_s=1)
    with pytest.raises(StorageUnavailable, match="opening the pool"):
        await open_pool(closed)


def test_the_dsn_never_shows_in_the_settings_repr() -> None:
    shown = repr(settings("postgresql://iop:hunter2@db/iop"))
    assert "hunter2" not in shown
