"""The SQLite kit against real files: the opener's checks, the batched writer's promises."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiosqlite
import pytest
from loguru import logger

from iop_proto.sqlite import BatchedWriter, WriterTuning, open_database, statement_migrations

SCHEMA = ("CREATE TABLE IF NOT EXISTS notes (id TEXT PRIMARY KEY, body TEXT NOT NULL)",)


class KitError(Exception):
    pass


class KitClosed(KitError):
    pass


@dataclass(frozen=True)
class Note:
    id: str
    body: str
    final: bool = True


class NoteWriter(BatchedWriter[Note]):
    """The smallest subclass: a key, a row, and a draft never replaces a final note."""

    what = "note log"
    noun = "note"
    statement = "INSERT OR REPLACE INTO notes (id, body) VALUES (?, ?)"
    error = KitError
    closed_error = KitClosed

    def _key(self, record: Note) -> str:
        return record.id

    def _row(self, record: Note) -> tuple[object, ...]:
        return (record.id, record.body)

    def _supersedes(self, new: Note, old: Note) -> bool:
        return new.final or not old.final

    def _shed_first(self, record: Note) -> bool:
        return not record.final


async def open_notes(path: Path, version: int = 1) -> aiosqlite.Connection:
    return await open_database(
        path,
        busy_timeout_s=0.05,
        what="note log",
        owner="kit",
        schema=SCHEMA,
        schema_version=version,
        synchronous="NORMAL",
        error=KitError,
        migrate=statement_migrations({1: ("ALTER TABLE notes ADD COLUMN tag TEXT",)}, version),
    )


async def open_writer(path: Path, max_pending: int = 1000, retry_s: float = 0.02) -> NoteWriter:
    db = await open_notes(path)
    writer = NoteWriter(db, path, WriterTuning(0.01, 50, max_pending, retry_s))
    writer.start("note-writer")
    return writer


def on_disk(path: Path) -> list[tuple[str, str]]:
    raw = sqlite3.connect(path)
    try:
        return raw.execute("SELECT id, body FROM notes ORDER BY id").fetchall()
    finally:
        raw.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "a" / "b" / "notes.db"


@pytest.fixture
async def notes(path: Path) -> AsyncIterator[NoteWriter]:
    writer = await open_writer(path)
    try:
        yield writer
    finally:
        await writer.aclose()


@pytest.fixture
def errors() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lines.append, level="ERROR", format="{message}")
    yield lines
    logger.remove(handler)


async def test_a_new_file_is_private_versioned_and_in_wal_mode(path: Path, tmp_path: Path) -> None:
    db = await open_notes(path)
    await db.close()

    modes = [stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a", path.parent, path)]
    assert modes == [0o700, 0o700, 0o600]
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
    finally:
        raw.close()


async def test_a_newer_file_is_refused_and_left_as_it_was(path: Path) -> None:
    path.parent.mkdir(parents=True)
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA user_version = 7")
    raw.close()

    with pytest.raises(KitError, match="version 7 is newer than this kit understands"):
        await open_notes(path)

    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    finally:
        raw.close()


async def test_an_older_file_is_migrated_in_one_transaction_with_its_rows(path: Path) -> None:
    await (await open_notes(path)).close()
    raw = sqlite3.connect(path)
    raw.execute("INSERT INTO notes VALUES ('n1', 'kept')")
    raw.commit()
    raw.close()

    db = await open_notes(path, version=2)
    try:
        columns = [row[1] for row in await db.execute_fetchall("PRAGMA table_info(notes)")]
        assert columns == ["id", "body", "tag"]
        assert list(await db.execute_fetchall("PRAGMA user_version")) == [(2,)]
    finally:
        await db.close()
    assert on_disk(path) == [("n1", "kept")]


async def test_put_returns_at_once_and_flush_writes_everything_in_batches(
    notes: NoteWriter, path: Path
) -> None:
    for n in range(120):
        notes.put(Note(f"n{n:03}", "x"))
    assert notes.unwritten()[0] == Note("n000", "x")

    await notes.flush()

    assert len(on_disk(path)) == 120
    assert notes.writes == 3  # max_batch 50
    assert notes.unwritten() == []


class SlowNoteWriter(NoteWriter):
    """Each row takes 5 ms in SQLite's thread (a function in the statement), so records
    keep arriving while a batch is written, as they do under steady traffic."""

    statement = "INSERT OR REPLACE INTO notes (id, body) VALUES (?, slow(?))"


def _slow(value: str) -> str:
    time.sleep(0.005)  # in the writer's thread, off the event loop
    return value


async def test_records_that_arrive_while_a_batch_is_written_wait_for_the_next_batch(
    path: Path,
) -> None:
    """Under steady traffic one transaction per ``flush_interval_s``, not one per record:
    what arrives during a write gathers for the next batch as the first burst did."""
    db = await open_notes(path)
    await db.create_function("slow", 1, _slow)
    interval = 0.3
    writer = SlowNoteWriter(db, path, WriterTuning(interval, 1000, 1000, 0.02))
    writer.start("note-writer")
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        for n in range(100):  # a record every 10 ms: about 1 s of steady traffic
            writer.put(Note(f"n{n:03}", "x"))
            await asyncio.sleep(0.01)
        await writer.flush()
        elapsed = loop.time() - began
    finally:
        await writer.aclose()
    assert len(on_disk(path)) == 100
    # one batch per interval (however slow the machine ran), and the flush's
    assert writer.writes <= elapsed / interval + 2, (writer.writes, elapsed)


async def test_a_record_put_again_replaces_the_unwritten_one_unless_it_may_not(
    notes: NoteWriter, path: Path
) -> None:
    notes.put(Note("a", "draft", final=False))
    notes.put(Note("a", "final"))
    notes.put(Note("a", "late draft", final=False))  # may not replace the final one
    notes.put(Note("b", "one"))
    notes.put(Note("b", "two"))

    assert notes.unwritten() == [Note("a", "final"), Note("b", "two")]
    await notes.flush()
    assert on_disk(path) == [("a", "final"), ("b", "two")]
    assert notes.writes == 1
    merged = notes.latest([Note("a", "old", final=False)], [Note("a", "new")])
    assert merged == [Note("a", "new")]


async def test_a_locked_database_is_retried_and_memory_stays_bounded(
    path: Path, errors: list[str]
) -> None:
    notes = await open_writer(path, max_pending=10)
    failed = asyncio.Event()
    handler = logger.add(
        lambda _: failed.set(), level="ERROR", filter=lambda r: "failed" in r["message"]
    )
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        notes.put(Note("d0", "draft", final=False))
        for n in range(10):
            notes.put(Note(f"f{n}", "final"))
        assert notes.dropped == 1  # the draft goes first
        flushed = asyncio.create_task(notes.flush())
        async with asyncio.timeout(10):
            await failed.wait()  # the writer tried, was refused, and said so
        assert not flushed.done()
        lock.execute("COMMIT")
        async with asyncio.timeout(10):
            await flushed
    finally:
        lock.close()
        logger.remove(handler)
        await notes.aclose()

    assert notes.failed_writes >= 1
    assert [row[0] for row in on_disk(path)] == [f"f{n}" for n in range(10)]
    assert any("1 unwritten note(s) dropped to bound memory" in line for line in errors)
    assert any("writing 10 note(s) failed" in line for line in errors)


async def test_aclose_gives_up_after_its_timeout_and_then_every_call_raises(
    path: Path, errors: list[str]
) -> None:
    notes = await open_writer(path)
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        notes.put(Note("n1", "x"))
        async with asyncio.timeout(10):
            await notes.aclose(timeout_s=0.2)
    finally:
        lock.close()

    assert any("1 note(s) not written within 0.2s of shutdown" in line for line in errors)
    await notes.aclose()  # idempotent
    with pytest.raises(KitClosed):
        notes.put(Note("n2", "x"))
    with pytest.raises(KitClosed):
        await notes.flush()


async def test_a_flush_fails_when_the_writer_is_gone(notes: NoteWriter) -> None:
    assert notes._writer is not None
    notes._writer.cancel()
    await asyncio.wait([notes._writer])
    notes.put(Note("n1", "x"))

    with pytest.raises(KitError, match="the writer has stopped"):
        await notes.flush()


def test_bad_tuning_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        WriterTuning(0.01, 0, 10, 0.1)
    with pytest.raises(ValueError, match="must not be negative"):
        WriterTuning(-1, 50, 10, 0.1)


async def test_a_waiting_flush_fails_when_the_writer_dies(path: Path) -> None:
    notes = await open_writer(path)
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # the writer keeps retrying: the flush waits
        notes.put(Note("n1", "x"))
        flushed = asyncio.create_task(notes.flush())
        await asyncio.sleep(0.1)
        assert not flushed.done()
        assert notes._writer is not None
        notes._writer.cancel()  # as a bug would end it
        async with asyncio.timeout(10):
            with pytest.raises(KitError, match="the writer has stopped"):
                await flushed
    finally:
        lock.close()
        await notes.aclose(timeout_s=0.5)


async def test_persist_returns_once_its_record_is_committed(path: Path) -> None:
    db = await open_notes(path)
    # A long coalescing pause: persist must not wait for it.
    notes = NoteWriter(db, path, WriterTuning(60, 50, 1000, 0.02))
    notes.start("note-writer")
    try:
        notes.put(Note("queued", "before"))
        async with asyncio.timeout(10):
            await notes.persist(Note("n1", "kept"))
        assert on_disk(path) == [("n1", "kept"), ("queued", "before")]  # FIFO: both committed
        lock = sqlite3.connect(path, isolation_level=None)
        try:
            lock.execute("BEGIN EXCLUSIVE")  # the writer is refused and retries
            persisted = asyncio.create_task(notes.persist(Note("n2", "first")))
            await asyncio.sleep(0.1)  # tried, refused, put back for a retry
            notes.put(Note("n2", "second"))  # replaces it unwritten: the waiter moves along
            await asyncio.sleep(0.1)
            assert not persisted.done()  # not acknowledged while it is not on disk
        finally:
            lock.execute("COMMIT")
            lock.close()
        async with asyncio.timeout(10):
            await persisted
        assert ("n2", "second") in on_disk(path)
    finally:
        await notes.aclose()


async def test_persist_fails_when_its_record_is_dropped_or_the_writer_stops(path: Path) -> None:
    notes = await open_writer(path, max_pending=2)
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        dropped = asyncio.create_task(notes.persist(Note("d0", "draft", final=False)))
        await asyncio.sleep(0)
        notes.put(Note("f1", "final"))
        notes.put(Note("f2", "final"))  # over max_pending: the draft goes
        async with asyncio.timeout(10):
            with pytest.raises(KitError, match="dropped"):
                await dropped
        stopped = asyncio.create_task(notes.persist(Note("f3", "final")))
        await asyncio.sleep(0.05)
        assert notes._writer is not None
        notes._writer.cancel()  # as a bug would end it
        async with asyncio.timeout(10):
            with pytest.raises(KitError, match="the writer has stopped"):
                await stopped
    finally:
        lock.close()
        await notes.aclose(timeout_s=0.5)
