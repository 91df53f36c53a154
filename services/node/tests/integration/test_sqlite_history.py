"""The SQLite run history against real database files: batched, never in the caller's way."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from iop_node.adapters.sqlite_history import (
    INTERRUPTED_CODE,
    INTERRUPTED_MESSAGE,
    SCHEMA_VERSION,
    HistoryClosed,
    HistoryError,
    SqliteRunHistory,
)
from iop_node.ports import RunHistory, RunRecord

T0 = 1_740_830_400_000  # 2025-03-01 12:00 UTC in Unix milliseconds


def started(run_id: str, received_ms: int = T0) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        model="llama3",
        provider_id="ollama-1",
        target="llama3:8b",
        operation="chat_completions",
        stream=True,
        outcome="running",
        received_ms=received_ms,
        started_ms=received_ms + 5,
    )


def completed(run_id: str, received_ms: int = T0) -> RunRecord:
    """Every field set, so a round trip through the table checks each column."""
    return replace(
        started(run_id, received_ms),
        outcome="completed",
        error_code="ERROR_CODE_PROVIDER_ERROR",
        error_message="upstream said 'no'",
        first_token_ms=received_ms + 40,
        finished_ms=received_ms + 900,
        prompt_tokens=12,
        completion_tokens=34,
        cached_tokens=9,
    )


def rows(path: Path) -> list[tuple[Any, ...]]:
    """What is on disk, read by a connection of its own (committed data only)."""
    raw = sqlite3.connect(path)
    try:
        return raw.execute(
            "SELECT run_id, outcome, error_code, error_message, finished_ms FROM runs "
            "ORDER BY run_id"
        ).fetchall()
    finally:
        raw.close()


def returns_at_once(result: object) -> None:
    """A history call's result: it returned, ``None``, nothing to await (no I/O waited for)."""
    assert result is None


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "runs.db"  # the parent does not exist yet


@pytest.fixture
async def history(db_path: Path) -> AsyncIterator[SqliteRunHistory]:
    opened = await SqliteRunHistory.open(db_path)
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
    history: SqliteRunHistory, db_path: Path
) -> None:
    store: RunHistory = history  # the port, satisfied
    assert await store.recent(10) == []
    assert stat.S_IMODE((await asyncio.to_thread(db_path.stat)).st_mode) == 0o600
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        indexes = {row[0] for row in raw.execute("SELECT name FROM sqlite_master")}
        assert {"runs", "runs_received", "runs_running"} <= indexes
    finally:
        raw.close()


async def test_a_run_started_and_completed_before_a_flush_is_written_once(
    history: SqliteRunHistory, db_path: Path
) -> None:
    history.run_started(started("r1"))
    history.complete_run(completed("r1"))
    await history.flush()

    assert history.writes == 1
    assert rows(db_path) == [
        ("r1", "completed", "ERROR_CODE_PROVIDER_ERROR", "upstream said 'no'", T0 + 900)
    ]
    assert await history.recent(5) == [completed("r1")]  # every column round-trips


async def test_a_run_written_at_start_is_replaced_by_its_completion(
    history: SqliteRunHistory, db_path: Path
) -> None:
    history.run_started(started("r1"))
    await history.flush()
    assert rows(db_path) == [("r1", "running", "", "", 0)]

    history.complete_run(completed("r1"))
    await history.flush()

    assert history.writes == 2
    assert rows(db_path) == [
        ("r1", "completed", "ERROR_CODE_PROVIDER_ERROR", "upstream said 'no'", T0 + 900)
    ]


async def test_a_late_start_never_undoes_a_completion(
    history: SqliteRunHistory, db_path: Path
) -> None:
    history.complete_run(completed("in-memory"))
    history.run_started(started("in-memory"))
    history.complete_run(completed("on-disk"))
    await history.flush()
    history.run_started(started("on-disk"))
    await history.flush()

    assert [row[:2] for row in rows(db_path)] == [
        ("in-memory", "completed"),
        ("on-disk", "completed"),
    ]


async def test_recent_lists_newest_first_including_unwritten_runs(
    history: SqliteRunHistory,
) -> None:
    for n in range(4):
        history.complete_run(completed(f"r{n}", T0 + n))
    await history.flush()
    history.run_started(started("r4", T0 + 4))  # still only in memory
    history.run_started(started("r1", T0 + 1))  # stale: r1 is complete on disk

    newest = await history.recent(3)

    assert [r.run_id for r in newest] == ["r4", "r3", "r2"]
    assert newest[0].outcome == "running"
    assert [r.outcome for r in await history.recent(10)][3] == "completed"  # r1
    assert await history.recent(0) == []


async def test_history_survives_a_restart(db_path: Path) -> None:
    first = await SqliteRunHistory.open(db_path)
    first.complete_run(completed("r1", T0))
    first.complete_run(completed("r2", T0 + 1))
    await first.aclose()  # writes what is pending

    second = await SqliteRunHistory.open(db_path)
    try:
        assert await second.recent(10) == [completed("r2", T0 + 1), completed("r1", T0)]
    finally:
        await second.aclose()


async def test_a_run_left_running_by_a_dead_process_is_marked_interrupted(
    db_path: Path, log: list[str]
) -> None:
    crashed = await SqliteRunHistory.open(db_path)
    crashed.run_started(started("lost"))
    crashed.complete_run(completed("done"))
    await crashed.flush()
    await crashed.aclose()  # the process dies here: "lost" never completes

    reopened = await SqliteRunHistory.open(db_path)
    try:
        lost = {r.run_id: r for r in await reopened.recent(10)}["lost"]
        assert (lost.outcome, lost.error_code, lost.error_message) == (
            "failed",
            INTERRUPTED_CODE,
            INTERRUPTED_MESSAGE,
        )
        assert lost.finished_ms > T0
        assert any("1 run(s) left running" in line for line in log)
        assert await reopened.mark_interrupted(T0) == 0  # "done" is untouched
    finally:
        await reopened.aclose()


async def test_calls_return_at_once_while_another_connection_holds_the_write_lock(
    db_path: Path,
) -> None:
    history = await SqliteRunHistory.open(db_path, busy_timeout_s=0.05, retry_delay_s=0.02)
    failed = asyncio.Event()
    failures: list[str] = []

    def on_error(message: str) -> None:
        failures.append(message)
        failed.set()

    handler = logger.add(on_error, level="ERROR", format="{message}")
    lock = sqlite3.connect(db_path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        returns_at_once(history.run_started(started("r1")))
        returns_at_once(history.complete_run(completed("r1")))
        flushed = asyncio.create_task(history.flush())
        async with asyncio.timeout(10):
            await failed.wait()  # the writer tried, was refused, and said so

        assert not flushed.done()
        assert lock.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
        assert "writing 1 run record(s) failed" in failures[0]
        assert "database is locked" in failures[0]  # with the traceback

        lock.execute("COMMIT")  # the lock goes; the writer's next retry gets through
        async with asyncio.timeout(10):
            await flushed
        assert history.failed_writes >= 1
        assert history.writes == 1
        assert [row[:2] for row in rows(db_path)] == [("r1", "completed")]
    finally:
        lock.close()
        logger.remove(handler)
        await history.aclose()


async def test_aclose_gives_up_on_a_locked_database_after_its_timeout(
    db_path: Path, log: list[str]
) -> None:
    history = await SqliteRunHistory.open(db_path, busy_timeout_s=0.05, retry_delay_s=0.02)
    lock = sqlite3.connect(db_path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        history.complete_run(completed("r1"))
        async with asyncio.timeout(10):
            await history.aclose(timeout_s=0.3)
    finally:
        lock.close()

    assert history.writes == 0
    assert any("1 run record(s) not written within 0.3s of shutdown" in line for line in log)
    with pytest.raises(HistoryClosed):
        history.run_started(started("r2"))


async def test_ten_thousand_runs_are_written_in_a_few_batches(
    history: SqliteRunHistory, db_path: Path
) -> None:
    for n in range(10_000):
        history.run_started(started(f"r{n:05}", T0 + n))
        history.complete_run(completed(f"r{n:05}", T0 + n))
    await history.flush()

    assert history.writes <= 25  # 10,000 / max_batch 500 = 20
    on_disk = rows(db_path)
    assert len(on_disk) == 10_000
    assert {row[1] for row in on_disk} == {"completed"}


async def test_pending_records_are_bounded_dropping_old_starts_first(
    db_path: Path, log: list[str]
) -> None:
    history = await SqliteRunHistory.open(db_path, max_pending=10)
    try:
        # No await yields to the writer in between, so all of these stay pending.
        history.run_started(started("s0"))
        for n in range(5):
            history.complete_run(completed(f"c{n}"))
        for n in range(1, 6):
            history.run_started(started(f"s{n}"))
        await history.flush()
    finally:
        await history.aclose()

    assert history.dropped == 1
    assert [row[0] for row in rows(db_path)] == [f"c{n}" for n in range(5)] + [
        f"s{n}" for n in range(1, 6)
    ]
    assert any("1 unwritten records dropped (1 starts, 0 completions)" in line for line in log)


async def test_after_aclose_every_call_raises(history: SqliteRunHistory) -> None:
    await history.aclose()
    await history.aclose()  # idempotent

    with pytest.raises(HistoryClosed):
        history.run_started(started("r1"))
    with pytest.raises(HistoryClosed):
        history.complete_run(completed("r1"))
    with pytest.raises(HistoryClosed):
        await history.recent(1)
    with pytest.raises(HistoryClosed):
        await history.flush()


async def test_a_schema_from_a_newer_node_is_refused(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1:d}")
    raw.close()

    with pytest.raises(HistoryError, match="newer than this node understands"):
        await SqliteRunHistory.open(db_path)


V1_TABLE = """CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, model TEXT NOT NULL, provider_id TEXT NOT NULL,
    target TEXT NOT NULL, operation TEXT NOT NULL, stream INTEGER NOT NULL,
    outcome TEXT NOT NULL, error_code TEXT NOT NULL, error_message TEXT NOT NULL,
    received_ms INTEGER NOT NULL, started_ms INTEGER NOT NULL,
    first_token_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL)"""


async def test_a_version_1_file_gains_the_cached_tokens_column(db_path: Path) -> None:
    """Runs recorded before the engines' cache was counted say 0; new ones keep theirs."""
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute(V1_TABLE)
    old = replace(completed("old"), cached_tokens=0)
    values = [getattr(old, name) for name in RunRecord.__dataclass_fields__][:-1]
    raw.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(values))})", values)
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()

    migrated = await SqliteRunHistory.open(db_path)
    try:
        migrated.complete_run(completed("new", T0 + 1))
        await migrated.flush()
        assert await migrated.recent(10) == [completed("new", T0 + 1), old]
    finally:
        await migrated.aclose()
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    finally:
        raw.close()
