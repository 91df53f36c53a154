"""The edge's run log against real databases, batched and never in the caller's way: the
same contract on a SQLite file and on a real PostgreSQL (``backend``), and what only one
of them has (a file's modes, locks and old versions; PostgreSQL's outages)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from loguru import logger

from iop_edge.adapters.postgres_runlog import COMPONENT, STEPS, PostgresRunLog
from iop_edge.adapters.sqlite_runlog import (
    SCHEMA_VERSION,
    RunLogClosed,
    RunLogError,
    SqliteRunLog,
)
from iop_edge.domain.usage import UsageRow
from iop_edge.ports import AttemptRecord, EdgeRunRecord, RunLog
from iop_proto.postgres import apply_migrations
from iop_proto.testing_postgres import PostgresServer

T0 = 1_740_830_400_000  # 2025-03-01 12:00 UTC in Unix milliseconds


def run(run_id: str, received_ms: int = T0, key_id: str = "key_1") -> EdgeRunRecord:
    """Every field set to a value of its own, so a round trip checks each column."""
    return EdgeRunRecord(
        run_id=run_id,
        model="llama3",
        provider_id="ollama-1",
        node_id="node-a",
        operation="chat_completions",
        stream=True,
        outcome="failed",
        status=502,
        error_code="provider_error",
        received_ms=received_ms,
        queue_wait_ms=7,
        ttft_ms=40,
        duration_ms=900,
        prompt_tokens=12,
        completion_tokens=34,
        key_id=key_id,
        attempts=(
            AttemptRecord("a1-" + run_id, "ollama-0", "node-b", "failed", "provider_unavailable"),
            AttemptRecord(run_id, "ollama-1", "node-a", "failed", "provider_error", T0 + 5, 890),
        ),
        cached_tokens=9,
        api="responses",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )


_ATTEMPTS = [f.name for f in dataclasses.fields(EdgeRunRecord)].index("attempts")


def as_row(record: EdgeRunRecord) -> tuple[Any, ...]:
    """A record as its row: the bool as 0/1 (equal to PostgreSQL's True), the attempts
    as JSON text (keys sorted: PostgreSQL's jsonb orders them its own way)."""
    plain = dataclasses.replace(record, stream=1)
    values = [getattr(plain, f.name) for f in dataclasses.fields(EdgeRunRecord)]
    values[_ATTEMPTS] = json.dumps([dataclasses.asdict(a) for a in record.attempts], sort_keys=True)
    return tuple(values)


def parsed(row: tuple[Any, ...]) -> tuple[Any, ...]:
    values = list(row)
    values[_ATTEMPTS] = json.dumps(json.loads(values[_ATTEMPTS]), sort_keys=True)
    return tuple(values)


def rows(path: Path) -> list[tuple[Any, ...]]:
    """What is on disk, read by a connection of its own (committed data only)."""
    raw = sqlite3.connect(path)
    try:
        return raw.execute("SELECT * FROM runs ORDER BY run_id").fetchall()
    finally:
        raw.close()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "edge" / "runs.db"  # neither directory exists yet


Log = SqliteRunLog | PostgresRunLog


class SqliteBackend:
    """Each ``open`` opens the one file again, as an edge restarting does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def open(self, **tuning: Any) -> Log:
        return await SqliteRunLog.open(self.path, **tuning)

    async def committed(self) -> list[tuple[Any, ...]]:
        return rows(self.path)

    async def aclose(self) -> None:
        pass


class PostgresBackend:
    """Each ``open`` is another edge on the one database: a pool and a log of its own."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.pools: list[asyncpg.Pool] = []

    async def open(self, **tuning: Any) -> Log:
        pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4, timeout=5)
        assert pool is not None
        self.pools.append(pool)
        return await PostgresRunLog.open(pool, **tuning)

    async def committed(self) -> list[tuple[Any, ...]]:
        """What another connection reads from the table: committed rows only."""
        connection = await asyncpg.connect(self.dsn)
        try:
            found = await connection.fetch("SELECT * FROM edge_runs ORDER BY run_id")
        finally:
            await connection.close()
        return [tuple(row) for row in found]

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.close()


Backend = SqliteBackend | PostgresBackend


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Backend]:
    """The contract's tests run on both; ``postgres`` on a fresh database of a real server."""
    opened: Backend
    if request.param == "sqlite":
        opened = SqliteBackend(db_path)
    else:
        opened = PostgresBackend(request.getfixturevalue("postgres_dsn"))
    try:
        yield opened
    finally:
        await opened.aclose()


@pytest.fixture
async def runlog(backend: Backend) -> AsyncIterator[Log]:
    opened = await backend.open()
    try:
        yield opened
    finally:
        await opened.aclose()


@pytest.fixture
async def sqlite_runlog(db_path: Path) -> AsyncIterator[SqliteRunLog]:
    opened = await SqliteRunLog.open(db_path)
    try:
        yield opened
    finally:
        await opened.aclose()


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lines.append, level="INFO", format="{level} {message}")
    yield lines
    logger.remove(handler)


async def test_open_creates_a_private_wal_database_with_a_versioned_schema(
    sqlite_runlog: SqliteRunLog, db_path: Path, tmp_path: Path
) -> None:
    store: RunLog = sqlite_runlog  # the port, satisfied
    assert await store.recent(10) == []
    paths = (tmp_path / "state", tmp_path / "state" / "edge", db_path)
    assert await asyncio.to_thread(lambda: [stat.S_IMODE(p.stat().st_mode) for p in paths]) == [
        0o700,
        0o700,
        0o600,
    ]
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert "runs_received" in {row[0] for row in raw.execute("SELECT name FROM sqlite_master")}
        columns = [row[1] for row in raw.execute("PRAGMA table_info(runs)")]
    finally:
        raw.close()
    assert columns == [field.name for field in dataclasses.fields(EdgeRunRecord)]


async def test_one_record_is_one_row_with_every_field(runlog: Log, backend: Backend) -> None:
    runlog.record(run("r1"))
    await runlog.flush()

    assert runlog.writes == 1
    assert [parsed(row) for row in await backend.committed()] == [as_row(run("r1"))]


async def test_recent_lists_newest_first_including_unwritten_records(runlog: Log) -> None:
    for n in (0, 1, 2):
        runlog.record(run(f"r{n}", T0 + n))
    await runlog.flush()
    runlog.record(run("r4", T0 + 4))  # these two stay in memory: nothing yields
    runlog.record(run("r3-b", T0 + 3))
    runlog.record(run("r3-a", T0 + 3))  # same millisecond: run_id breaks the tie

    assert [r.run_id for r in await runlog.recent(4)] == ["r4", "r3-b", "r3-a", "r2"]
    assert [r.run_id for r in await runlog.recent(10)] == [
        "r4",
        "r3-b",
        "r3-a",
        "r2",
        "r1",
        "r0",
    ]
    assert await runlog.recent(0) == []


async def test_a_record_survives_a_reopen_with_every_field(backend: Backend) -> None:
    first = await backend.open()
    first.record(run("r1", T0))
    first.record(run("r2", T0 + 1))
    await first.aclose()  # writes what is pending

    second = await backend.open()
    try:
        assert await second.recent(10) == [run("r2", T0 + 1), run("r1", T0)]
    finally:
        await second.aclose()


async def test_record_returns_at_once_while_another_connection_holds_the_write_lock(
    db_path: Path,
) -> None:
    runlog = await SqliteRunLog.open(db_path, busy_timeout_s=0.05, retry_delay_s=0.02)
    failed = asyncio.Event()
    failures: list[str] = []

    def on_error(message: str) -> None:
        failures.append(message)
        failed.set()

    handler = logger.add(on_error, level="ERROR", format="{message}")
    lock = sqlite3.connect(db_path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        runlog.record(run("r1"))  # synchronous: it returns at once, the file locked or not
        assert [r.run_id for r in runlog.unwritten()] == ["r1"]  # queued, not written
        flushed = asyncio.create_task(runlog.flush())
        async with asyncio.timeout(10):
            await failed.wait()  # the writer tried, was refused, and said so

        assert not flushed.done()
        assert lock.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
        assert "writing 1 run record(s) failed" in failures[0]
        assert "database is locked" in failures[0]  # with the traceback
        assert [r.run_id for r in await runlog.recent(5)] == ["r1"]  # still visible

        lock.execute("COMMIT")  # the lock goes; the writer's next retry gets through
        async with asyncio.timeout(10):
            await flushed
        assert runlog.failed_writes >= 1
        assert runlog.writes == 1
        assert [row[0] for row in rows(db_path)] == ["r1"]
    finally:
        lock.close()
        logger.remove(handler)
        await runlog.aclose()


async def test_aclose_gives_up_on_a_locked_database_after_its_timeout(
    db_path: Path, log: list[str]
) -> None:
    runlog = await SqliteRunLog.open(db_path, busy_timeout_s=0.05, retry_delay_s=0.02)
    lock = sqlite3.connect(db_path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        runlog.record(run("r1"))
        async with asyncio.timeout(10):
            await runlog.aclose(timeout_s=0.3)
    finally:
        lock.close()

    assert runlog.writes == 0
    assert any("1 run record(s) not written within 0.3s of shutdown" in line for line in log)


async def test_ten_thousand_records_are_written_in_a_few_batches(
    runlog: Log, backend: Backend
) -> None:
    for n in range(10_000):
        runlog.record(run(f"r{n:05}", T0 + n))
    await runlog.flush()

    assert runlog.writes <= 25  # 10,000 / max_batch 500 = 20
    assert len(await backend.committed()) == 10_000
    assert (await runlog.recent(1))[0].run_id == "r09999"


async def test_pending_records_are_bounded_dropping_the_oldest(
    backend: Backend, log: list[str]
) -> None:
    runlog = await backend.open(max_pending=10)
    try:
        for n in range(12):  # no await yields to the writer, so all of these stay pending
            runlog.record(run(f"r{n:02}", T0 + n))
        await runlog.flush()
    finally:
        await runlog.aclose()

    assert runlog.dropped == 2  # one line for the first, one for the second excess record
    assert [row[0] for row in await backend.committed()] == [f"r{n:02}" for n in range(2, 12)]
    assert sum("unwritten run record(s) dropped" in line for line in log) == 2


async def test_after_aclose_every_call_raises(runlog: Log) -> None:
    await runlog.aclose()
    await runlog.aclose()  # idempotent

    with pytest.raises(RunLogClosed):
        runlog.record(run("r1"))
    with pytest.raises(RunLogClosed):
        await runlog.recent(1)
    with pytest.raises(RunLogClosed):
        await runlog.flush()


async def test_a_schema_from_a_newer_edge_is_refused_and_left_alone(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1:d}")
    raw.close()

    with pytest.raises(RunLogError, match="newer than this edge understands"):
        await SqliteRunLog.open(db_path)

    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # untouched
    finally:
        raw.close()


async def test_recent_of_one_key_lists_only_that_key_s_runs(runlog: Log) -> None:
    for n, key_id in enumerate(("key_a", "key_b", "key_a", "")):
        runlog.record(run(f"r{n}", T0 + n, key_id))
    await runlog.flush()
    runlog.record(run("r9", T0 + 9, "key_b"))  # still in memory

    assert [r.run_id for r in await runlog.recent(10, key_id="key_a")] == ["r2", "r0"]
    assert [r.run_id for r in await runlog.recent(10, key_id="key_b")] == ["r9", "r1"]
    assert [r.run_id for r in await runlog.recent(1, key_id="key_b")] == ["r9"]
    assert [r.run_id for r in await runlog.recent(10)] == ["r9", "r3", "r2", "r1", "r0"]


def used(
    run_id: str, received_ms: int, key_id: str, api: str, outcome: str = "completed", **more: Any
) -> EdgeRunRecord:
    """A run of ``key_id`` through ``api``: 12 tokens in, 34 out (``run``'s)."""
    return dataclasses.replace(run(run_id, received_ms, key_id), api=api, outcome=outcome, **more)


async def test_usage_adds_up_each_key_s_runs_by_model_and_api_since_a_time(runlog: Log) -> None:
    runlog.record(used("old", T0 - 1, "key_a", "messages"))  # before the window
    runlog.record(used("a1", T0, "key_a", "chat_completions"))
    runlog.record(used("a2", T0 + 1, "key_a", "chat_completions", "failed"))
    runlog.record(used("a3", T0 + 2, "key_a", "chat_completions", "rejected", prompt_tokens=0))
    runlog.record(used("a4", T0 + 3, "key_a", "batch", "cancelled", model="qwen"))
    runlog.record(used("b1", T0 + 4, "key_b", "responses", completion_tokens=1))
    await runlog.flush()
    # In memory only: a new run, and a new version of one already written (counted once).
    runlog.record(used("b2", T0 + 5, "key_b", "responses", completion_tokens=1))
    runlog.record(used("a1", T0, "key_a", "chat_completions", completion_tokens=100))

    rows = {(r.key_id, r.model, r.api): r for r in await runlog.usage(T0)}
    assert rows == {
        ("key_a", "llama3", "chat_completions"): UsageRow(
            "key_a", "llama3", "chat_completions", 3, 2, 24, 168
        ),
        ("key_a", "qwen", "batch"): UsageRow("key_a", "qwen", "batch", 1, 0, 12, 34),
        ("key_b", "llama3", "responses"): UsageRow("key_b", "llama3", "responses", 2, 0, 24, 2),
    }
    assert await runlog.usage(T0 + 4, key_id="key_b") == [
        UsageRow("key_b", "llama3", "responses", 2, 0, 24, 2)
    ]
    assert await runlog.usage(T0 + 6) == []
    # Once all is written the sums are the same: nothing counted twice, nothing lost.
    await runlog.flush()
    assert {(r.key_id, r.model, r.api): r for r in await runlog.usage(T0)} == rows
    (every,) = [r for r in await runlog.usage(T0 - 1) if r.api == "messages"]
    assert every == UsageRow("key_a", "llama3", "messages", 1, 0, 12, 34)


V1_TABLE = """CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, model TEXT NOT NULL, provider_id TEXT NOT NULL,
    node_id TEXT NOT NULL, operation TEXT NOT NULL, stream INTEGER NOT NULL,
    outcome TEXT NOT NULL, status INTEGER NOT NULL, error_code TEXT NOT NULL,
    received_ms INTEGER NOT NULL, queue_wait_ms INTEGER NOT NULL, ttft_ms INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL)"""


async def test_a_version_1_file_is_migrated_and_keeps_its_runs(db_path: Path) -> None:
    """Runs recorded before keys were recorded belong to no key (operators still see them)."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(V1_TABLE)
    old = as_row(run("old"))[: _ATTEMPTS - 1]
    raw.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(old))})", old)
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()

    migrated = await SqliteRunLog.open(db_path)
    try:
        migrated.record(run("new", T0 + 1, "key_a"))
        await migrated.flush()
        old_run = dataclasses.replace(
            run("old"), key_id="", attempts=(), cached_tokens=0, api="", trace_id=""
        )
        assert await migrated.recent(10) == [run("new", T0 + 1, "key_a"), old_run]
        assert [r.run_id for r in await migrated.recent(10, key_id="key_a")] == ["new"]
    finally:
        await migrated.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
    finally:
        raw.close()


async def test_a_version_2_file_gains_the_attempts_column(db_path: Path) -> None:
    """Runs recorded before attempts were list none; new ones keep every attempt."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(V1_TABLE)
    raw.execute("ALTER TABLE runs ADD COLUMN key_id TEXT NOT NULL DEFAULT ''")
    old = as_row(run("old"))[:_ATTEMPTS]
    raw.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(old))})", old)
    raw.execute("PRAGMA user_version = 2")
    raw.commit()
    raw.close()

    migrated = await SqliteRunLog.open(db_path)
    try:
        migrated.record(run("new", T0 + 1))
        await migrated.flush()
        old_run = dataclasses.replace(run("old"), attempts=(), cached_tokens=0, api="", trace_id="")
        assert await migrated.recent(10) == [run("new", T0 + 1), old_run]
    finally:
        await migrated.aclose()


async def test_a_version_3_file_gains_the_cached_tokens_column(db_path: Path) -> None:
    """Runs recorded before the engines' cache was counted say 0; new ones keep theirs."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(V1_TABLE)
    raw.execute("ALTER TABLE runs ADD COLUMN key_id TEXT NOT NULL DEFAULT ''")
    raw.execute("ALTER TABLE runs ADD COLUMN attempts TEXT NOT NULL DEFAULT '[]'")
    old = as_row(run("old"))[: _ATTEMPTS + 1]
    raw.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(old))})", old)
    raw.execute("PRAGMA user_version = 3")
    raw.commit()
    raw.close()

    migrated = await SqliteRunLog.open(db_path)
    try:
        migrated.record(run("new", T0 + 1))
        await migrated.flush()
        old_run = dataclasses.replace(run("old"), cached_tokens=0, api="", trace_id="")
        assert await migrated.recent(10) == [run("new", T0 + 1), old_run]
        assert (await migrated.recent(1))[0].cached_tokens == 9
    finally:
        await migrated.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        raw.close()


async def test_a_version_4_file_gains_the_api_column(db_path: Path) -> None:
    """Runs recorded before the API was recorded say '' (their operation cannot tell a
    Responses or Messages run from a chat completion); new ones keep theirs."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(V1_TABLE)
    raw.execute("ALTER TABLE runs ADD COLUMN key_id TEXT NOT NULL DEFAULT ''")
    raw.execute("ALTER TABLE runs ADD COLUMN attempts TEXT NOT NULL DEFAULT '[]'")
    raw.execute("ALTER TABLE runs ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0")
    old = as_row(run("old"))[:-2]
    raw.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(old))})", old)
    raw.execute("PRAGMA user_version = 4")
    raw.commit()
    raw.close()

    migrated = await SqliteRunLog.open(db_path)
    try:
        migrated.record(run("new", T0 + 1))
        await migrated.flush()
        assert await migrated.recent(10) == [
            run("new", T0 + 1),
            dataclasses.replace(run("old"), api="", trace_id=""),
        ]
        assert {r.api for r in await migrated.usage(T0)} == {"", "responses"}
    finally:
        await migrated.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        raw.close()


async def test_a_version_5_file_gains_the_trace_id_column(db_path: Path) -> None:
    """Runs recorded before traces say '' (not traced); new ones keep their trace id."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(V1_TABLE)
    raw.execute("ALTER TABLE runs ADD COLUMN key_id TEXT NOT NULL DEFAULT ''")
    raw.execute("ALTER TABLE runs ADD COLUMN attempts TEXT NOT NULL DEFAULT '[]'")
    raw.execute("ALTER TABLE runs ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0")
    raw.execute("ALTER TABLE runs ADD COLUMN api TEXT NOT NULL DEFAULT ''")
    old = as_row(run("old"))[:-1]
    raw.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(old))})", old)
    raw.execute("PRAGMA user_version = 5")
    raw.commit()
    raw.close()

    migrated = await SqliteRunLog.open(db_path)
    try:
        migrated.record(run("new", T0 + 1))
        await migrated.flush()
        assert await migrated.recent(10) == [
            run("new", T0 + 1),
            dataclasses.replace(run("old"), trace_id=""),
        ]
        assert (await migrated.recent(1))[0].trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    finally:
        await migrated.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        raw.close()


# -- PostgreSQL: the table, and its outages ---------------------------------------


@pytest.fixture
async def postgres(postgres_dsn: str) -> AsyncIterator[PostgresBackend]:
    opened = PostgresBackend(postgres_dsn)
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_the_table_has_a_column_per_field_and_every_edge_s_runs(
    postgres: PostgresBackend,
) -> None:
    edge_a, edge_b = await asyncio.gather(postgres.open(), postgres.open())  # migrate once
    try:
        edge_a.record(run("a1", T0))
        edge_b.record(run("b1", T0 + 1))
        await asyncio.gather(edge_a.flush(), edge_b.flush())
        assert [r.run_id for r in await edge_a.recent(10)] == ["b1", "a1"]
        connection = await asyncpg.connect(postgres.dsn)
        try:
            columns = await connection.fetch(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_name = 'edge_runs' ORDER BY ordinal_position"
            )
        finally:
            await connection.close()
        assert [c[0] for c in columns] == [
            field.name for field in dataclasses.fields(EdgeRunRecord)
        ]
    finally:
        await edge_a.aclose()
        await edge_b.aclose()


async def test_usage_adds_up_every_edge_s_runs(postgres: PostgresBackend) -> None:
    """Two edges on one database: each one's usage is the fleet's, its own unwritten
    runs included (the other edge's count once written)."""
    edge_a, edge_b = await asyncio.gather(postgres.open(), postgres.open())
    try:
        edge_a.record(used("a1", T0, "key_a", "messages"))
        edge_b.record(used("b1", T0 + 1, "key_a", "messages", "failed"))
        await edge_b.flush()
        edge_a.record(used("a2", T0 + 2, "key_a", "batch"))  # A's, unwritten
        expected = [
            UsageRow("key_a", "llama3", "messages", 2, 1, 24, 68),
            UsageRow("key_a", "llama3", "batch", 1, 0, 12, 34),
        ]
        assert sorted(await edge_a.usage(T0), key=str) == sorted(expected, key=str)
        await edge_a.flush()
        assert sorted(await edge_b.usage(T0, "key_a"), key=str) == sorted(expected, key=str)
    finally:
        await edge_a.aclose()
        await edge_b.aclose()


async def test_a_step_1_table_gains_the_api_column_and_keeps_its_runs(
    postgres: PostgresBackend,
) -> None:
    """A database an edge of the previous release made (step 1): its rows say ''."""
    pool = await asyncpg.create_pool(postgres.dsn, min_size=1, max_size=2, timeout=5)
    assert pool is not None
    postgres.pools.append(pool)
    assert await apply_migrations(pool, COMPONENT, STEPS[:1]) == 1
    old = as_row(run("old"))[:-2]
    await pool.execute(
        f"INSERT INTO edge_runs VALUES ({', '.join(f'${n}' for n in range(1, len(old) + 1))})",
        *(True if n == 5 else v for n, v in enumerate(old)),
    )
    upgraded = await postgres.open()
    try:
        upgraded.record(run("new", T0 + 1))
        await upgraded.flush()
        assert await upgraded.recent(10) == [
            run("new", T0 + 1),
            dataclasses.replace(run("old"), api="", trace_id=""),
        ]
        assert await pool.fetchval(
            "SELECT version FROM iop_schema_versions WHERE component = $1", COMPONENT
        ) == len(STEPS)
    finally:
        await upgraded.aclose()


async def test_a_step_2_table_gains_the_trace_id_column_and_keeps_its_runs(
    postgres: PostgresBackend,
) -> None:
    """A database of the release before traces (step 2): its rows say '' (not traced)."""
    pool = await asyncpg.create_pool(postgres.dsn, min_size=1, max_size=2, timeout=5)
    assert pool is not None
    postgres.pools.append(pool)
    assert await apply_migrations(pool, COMPONENT, STEPS[:2]) == 2
    old = as_row(run("old"))[:-1]
    await pool.execute(
        f"INSERT INTO edge_runs VALUES ({', '.join(f'${n}' for n in range(1, len(old) + 1))})",
        *(True if n == 5 else v for n, v in enumerate(old)),
    )
    upgraded = await postgres.open()
    try:
        upgraded.record(run("new", T0 + 1))
        await upgraded.flush()
        assert await upgraded.recent(10) == [
            run("new", T0 + 1),
            dataclasses.replace(run("old"), trace_id=""),
        ]
    finally:
        await upgraded.aclose()


async def test_records_made_while_the_server_is_down_are_written_once_it_is_back(
    postgres_server: PostgresServer, postgres: PostgresBackend
) -> None:
    runlog = await postgres.open(retry_delay_s=0.05)
    failed = asyncio.Event()
    failures: list[str] = []

    def on_error(message: str) -> None:
        failures.append(message)
        failed.set()

    handler = logger.add(on_error, level="ERROR", format="{message}")
    try:
        runlog.record(run("r0", T0))
        await runlog.flush()
        await asyncio.to_thread(postgres_server.down)
        try:
            for n in (1, 2, 3):  # synchronous: each returns at once, the server down or not
                runlog.record(run(f"r{n}", T0 + n))
            assert [r.run_id for r in runlog.unwritten()] == ["r1", "r2", "r3"]
            flushed = asyncio.create_task(runlog.flush())
            async with asyncio.timeout(30):
                await failed.wait()  # the writer tried, was refused, and said so
            assert not flushed.done()
            assert "writing 3 run record(s) failed" in failures[0]
            assert "StorageUnavailable" in failures[0]  # with the traceback
            assert runlog.unwritten() != []  # kept for a retry, not dropped
        finally:
            await asyncio.to_thread(postgres_server.up)
        async with asyncio.timeout(60):  # the writer's next retry gets through
            await flushed
        assert runlog.failed_writes >= 1
        assert runlog.dropped == 0
        assert [row[0] for row in await postgres.committed()] == ["r0", "r1", "r2", "r3"]
        assert [r.run_id for r in await runlog.recent(10)] == ["r3", "r2", "r1", "r0"]
    finally:
        logger.remove(handler)
        await runlog.aclose()


async def test_aclose_gives_up_on_a_server_that_stays_down_after_its_timeout(
    postgres_server: PostgresServer, postgres: PostgresBackend, log: list[str]
) -> None:
    runlog = await postgres.open(retry_delay_s=0.05)
    await asyncio.to_thread(postgres_server.down)
    try:
        runlog.record(run("r1"))
        async with asyncio.timeout(30):
            await runlog.aclose(timeout_s=0.5)
    finally:
        await asyncio.to_thread(postgres_server.up)

    assert runlog.writes == 0
    assert any("1 run record(s) not written within 0.5s of shutdown" in line for line in log)
