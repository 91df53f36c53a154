"""The edge's store of Responses API answers against real databases: the same contract on
SQLite files and on a real PostgreSQL (``backend``), and what only one of them has (a
file's modes and old versions; several edges on one PostgreSQL, and its outages)."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from iop_edge.adapters.postgres_responses import PostgresResponseStore
from iop_edge.adapters.sqlite_responses import (
    PURGE_GRACE_S,
    ResponseLimits,
    ResponseStoreClosed,
    SqliteResponseStore,
)
from iop_edge.errors import StorageQuotaExceeded
from iop_edge.ports import ResponseStore, StoredResponse
from iop_proto.postgres import StorageUnavailable
from iop_proto.testing_postgres import PostgresServer

T0 = 1_800_000_000


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


def turn(
    response_id: str, previous: StoredResponse | None = None, key_id: str = "key_a"
) -> StoredResponse:
    return StoredResponse(
        response_id,
        key_id,
        T0,
        b'{"id":"%s","output":[]}' % response_id.encode(),
        b'[{"id":"in_%s"}]' % response_id.encode(),
        None if previous is None else previous.response_id,
        0 if previous is None else previous.depth + 1,
    )


def rows_on_disk(path: Path) -> list[str]:
    """What another connection reads from the file: committed rows only."""
    with sqlite3.connect(path) as db:
        return [str(r[0]) for r in db.execute("SELECT response_id FROM responses ORDER BY 1")]


Store = SqliteResponseStore | PostgresResponseStore


class SqliteBackend:
    """Each ``open`` opens the one file again, as an edge restarting does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def open(
        self,
        *,
        limits: ResponseLimits | None = None,
        clock: Callable[[], float] | None = None,
        **sqlite_options: Any,
    ) -> Store:
        extra: dict[str, Any] = {} if clock is None else {"clock": clock}
        return await SqliteResponseStore.open(self.path, limits=limits, **extra, **sqlite_options)

    async def committed(self) -> list[str]:
        return rows_on_disk(self.path)

    async def aclose(self) -> None:
        pass


class PostgresBackend:
    """Each ``open`` is another edge on the one database: a pool and a store of its own."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.pools: list[asyncpg.Pool] = []

    async def open(
        self,
        *,
        limits: ResponseLimits | None = None,
        clock: Callable[[], float] | None = None,
        **sqlite_options: Any,  # the SQLite writer's tuning: nothing to tune here
    ) -> Store:
        pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4)
        assert pool is not None
        self.pools.append(pool)
        extra: dict[str, Any] = {} if clock is None else {"clock": clock}
        return await PostgresResponseStore.open(pool, limits=limits, **extra)

    async def committed(self) -> list[str]:
        """What another connection reads from the table: committed rows only."""
        connection = await asyncpg.connect(self.dsn)
        try:
            rows = await connection.fetch("SELECT response_id FROM edge_responses ORDER BY 1")
        finally:
            await connection.close()
        return [str(r[0]) for r in rows]

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.close()


Backend = SqliteBackend | PostgresBackend


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """The contract's tests run on both; ``postgres`` on a fresh database of a real server."""
    opened: Backend
    if request.param == "sqlite":
        opened = SqliteBackend(tmp_path / "state" / "responses.db")
    else:
        opened = PostgresBackend(request.getfixturevalue("postgres_dsn"))
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_a_kept_turn_is_committed_when_keep_returns(backend: Backend) -> None:
    store = await backend.open(flush_interval_s=60)  # SQLite: no coalescing wait
    try:
        port: ResponseStore = store  # the port, satisfied
        await port.keep(turn("resp_1"))
        assert await backend.committed() == ["resp_1"]  # stored before the caller answers
        assert await store.get("resp_1", "key_a") == turn("resp_1")
        assert await store.get("resp_1", "key_b") is None  # another key's: not found
        assert await store.get("resp_2", "key_a") is None
    finally:
        await store.aclose()
    reopened = await backend.open()
    try:
        assert await reopened.get("resp_1", "key_a") == turn("resp_1")
        assert reopened.usage("key_a") == turn("resp_1").size
        assert await reopened.delete("resp_1", "key_a")
        assert await reopened.get("resp_1", "key_a") is None
        assert await backend.committed() == []  # nothing continued it: its bytes free at once
        assert reopened.usage("key_a") == 0
        assert not await reopened.delete("resp_1", "key_a")
    finally:
        await reopened.aclose()


async def test_the_file_is_its_owner_s_only(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.db"
    store = await SqliteResponseStore.open(path)
    try:
        await store.keep(turn("resp_1"))
    finally:
        await store.aclose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # clients' conversations: owner only
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


async def test_a_conversation_is_its_chain_of_turns_each_stored_once(backend: Backend) -> None:
    clock = Clock()
    store = await backend.open(clock=clock)
    try:
        first = turn("resp_1")
        second = turn("resp_2", first)
        third = turn("resp_3", second)
        for each in (first, second, third):
            await store.keep(each)
        assert await store.chain("resp_3", "key_a") == [first, second, third]
        assert await store.chain("resp_3", "key_b") is None
        assert await store.chain("resp_9", "key_a") is None
        assert store.usage("key_a") == sum(t.size for t in (first, second, third))

        # Deleting a turn in the middle: it is gone, the turn after it still continues.
        assert await store.delete("resp_2", "key_a")
        assert await store.get("resp_2", "key_a") is None
        assert await store.chain("resp_2", "key_a") is None
        chain = await store.chain("resp_3", "key_a")
        assert chain is not None
        assert [t.response_id for t in chain] == ["resp_1", "resp_2", "resp_3"]
        clock.now += PURGE_GRACE_S + 1
        assert await store.sweep() == 0  # resp_3 still continues from it
        assert await store.delete("resp_3", "key_a")  # nothing continues it: gone at once
        assert await backend.committed() == ["resp_1", "resp_2"]
        clock.now += PURGE_GRACE_S + 1
        assert await store.sweep() == 1  # then the deleted middle it held
        assert await store.get("resp_1", "key_a") == first
        assert store.usage("key_a") == first.size
    finally:
        await store.aclose()


async def test_turns_expire_then_go_and_a_key_s_bytes_are_capped(backend: Backend) -> None:
    clock = Clock()
    limits = ResponseLimits(ttl_s=100, quota_bytes=200, max_depth=2)
    store = await backend.open(clock=clock, limits=limits)
    try:
        first = turn("resp_1")
        await store.keep(first)
        await store.keep(turn("resp_2", first))
        store.admit("key_a", 200 - 2 * first.size)
        with pytest.raises(StorageQuotaExceeded):
            store.admit("key_a", 200 - 2 * first.size + 20)
        store.admit("key_b", 200)  # a quota per key
        clock.now = T0 + 100
        assert await store.get("resp_1", "key_a") is None  # expired: not found
        assert await store.chain("resp_2", "key_a") is None
        assert await store.sweep() == 0  # the grace first
        clock.now = T0 + 100 + PURGE_GRACE_S
        assert await store.sweep() == 2
        assert await backend.committed() == []
        assert store.usage("key_a") == 0
        store.admit("key_a", 200)
    finally:
        await store.aclose()


async def test_a_chain_is_read_no_deeper_than_its_bound(backend: Backend) -> None:
    limits = ResponseLimits(max_depth=3)
    store = await backend.open(limits=limits)
    try:
        links = [turn("resp_0")]
        for n in range(1, 6):
            links.append(turn(f"resp_{n}", links[-1]))
        for each in links:
            await store.keep(each)
        assert store.max_depth == 3
        assert await store.chain("resp_3", "key_a") == links[:4]
        assert await store.chain("resp_5", "key_a") is None  # past the bound: never read whole
    finally:
        await store.aclose()


async def test_a_version_1_file_reads_and_continues_as_before(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    with sqlite3.connect(path) as db:
        db.execute(
            """CREATE TABLE responses (response_id TEXT PRIMARY KEY, key_id TEXT NOT NULL,
            created_at INTEGER NOT NULL, response_json BLOB NOT NULL, input_json BLOB NOT NULL,
            deleted INTEGER NOT NULL DEFAULT 0)"""
        )
        db.execute(
            "INSERT INTO responses VALUES ('resp_old', 'key_a', ?, ?, ?, 0)",
            (T0, b'{"id":"resp_old"}', b'[{"id":"a"},{"id":"b"}]'),
        )
        db.execute(
            "INSERT INTO responses VALUES ('resp_gone', 'key_a', ?, ?, ?, 1)", (T0, b"{}", b"[]")
        )
        db.execute("PRAGMA user_version = 1")
    clock = Clock()
    store = await SqliteResponseStore.open(path, clock=clock)
    try:
        old = await store.get("resp_old", "key_a")
        assert old is not None
        assert (old.input_json, old.previous_id, old.depth) == (b'[{"id":"a"},{"id":"b"}]', None, 0)
        assert await store.get("resp_gone", "key_a") is None
        await store.keep(turn("resp_new", old))
        chain = await store.chain("resp_new", "key_a")
        assert chain is not None
        assert [t.response_id for t in chain] == ["resp_old", "resp_new"]
        assert store.usage("key_a") == old.size + 4 + turn("resp_new", old).size
        assert await store.sweep() == 1  # version 1's tombstone
    finally:
        await store.aclose()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2


async def test_a_closed_store_refuses_use(backend: Backend) -> None:
    store = await backend.open()
    await store.aclose()
    with pytest.raises(ResponseStoreClosed):
        await store.keep(turn("resp_1"))
    with pytest.raises(ResponseStoreClosed):
        await store.get("resp_1", "key_a")


# -- several edges on one PostgreSQL, and its outages --------------------------------


@pytest.fixture
async def postgres(postgres_dsn: str) -> AsyncIterator[PostgresBackend]:
    opened = PostgresBackend(postgres_dsn)
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_a_turn_kept_on_one_edge_continues_on_another(postgres: PostgresBackend) -> None:
    edge_a, edge_b = await asyncio.gather(postgres.open(), postgres.open())  # migrate once
    try:
        first = turn("resp_1")
        await edge_a.keep(first)
        assert await edge_b.get("resp_1", "key_a") == first
        assert await edge_b.get("resp_1", "key_b") is None  # another key's: on no edge
        assert await edge_b.chain("resp_1", "key_b") is None
        second = turn("resp_2", first)  # continued on edge B
        await edge_b.keep(second)
        assert await edge_a.chain("resp_2", "key_a") == [first, second]
        assert await edge_a.chain("resp_2", "key_b") is None
        assert await postgres.committed() == ["resp_1", "resp_2"]  # each turn once

        # What one edge keeps counts against the key's quota on the other.
        assert edge_b.usage("key_a") == first.size + second.size  # its own keep read it
        await edge_a.refresh_usage()  # (every usage_refresh_s on its own)
        assert edge_a.usage("key_a") == first.size + second.size

        assert await edge_b.delete("resp_2", "key_a")
        assert await edge_a.get("resp_2", "key_a") is None
        assert await edge_a.chain("resp_1", "key_a") == [first]
    finally:
        await edge_a.aclose()
        await edge_b.aclose()


async def test_an_outage_is_storage_unavailable_and_loses_nothing_committed(
    postgres_server: PostgresServer, postgres: PostgresBackend
) -> None:
    store = await postgres.open()
    try:
        first = turn("resp_1")
        second = turn("resp_2", first)
        await store.keep(first)
        await store.keep(second)
        await asyncio.to_thread(postgres_server.down)
        try:
            with pytest.raises(StorageUnavailable, match="storing a response"):
                await store.keep(turn("resp_3", second))
            with pytest.raises(StorageUnavailable):
                await store.get("resp_1", "key_a")
            with pytest.raises(StorageUnavailable):
                await store.chain("resp_2", "key_a")
            with pytest.raises(StorageUnavailable):
                await store.delete("resp_2", "key_a")
            with pytest.raises(StorageUnavailable):  # known down: refused before it runs
                store.admit("key_a", 10)
        finally:
            await asyncio.to_thread(postgres_server.up)
        async with asyncio.timeout(30):  # admit's own probe finds the server back
            while True:
                try:
                    store.admit("key_a", 10)
                    break
                except StorageUnavailable:
                    await asyncio.sleep(0.05)
        assert await store.chain("resp_2", "key_a") == [first, second]
        assert await store.get("resp_3", "key_a") is None  # refused, so never stored
        assert await postgres.committed() == ["resp_1", "resp_2"]
        await store.keep(turn("resp_3", second))  # and the pool serves again
        assert await postgres.committed() == ["resp_1", "resp_2", "resp_3"]
    finally:
        await store.aclose()
