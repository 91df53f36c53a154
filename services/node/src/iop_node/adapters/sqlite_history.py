"""Run history in one SQLite file, written by one background task in batches.

The request path must never wait for a disk: ``run_started`` and
``complete_run`` only put the record in an in-memory map keyed by run id and
wake the writer, which commits whatever is pending in one transaction per
batch. Keying by run id means a short run whose completion arrives before its
start was written costs one row write, not two.

Durability is traded knowingly: records still in memory when the process is
killed are lost, and ``synchronous = NORMAL`` under WAL may lose the last
commits on power loss (never corrupting the file). A run whose start reached
the disk but whose end did not is turned into ``failed``/``interrupted`` by the
next ``open``, so a crash leaves a visible trace rather than a run that
"runs" forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiosqlite
from loguru import logger

from iop_node.errors import NodeError
from iop_node.ports import RunRecord

SCHEMA_VERSION = 1
"""Kept in ``PRAGMA user_version``; bump it with a migration when the table changes."""

RUNNING = "running"
INTERRUPTED_CODE = "interrupted"
INTERRUPTED_MESSAGE = "node stopped before the run finished"

# The record's fields, in order, are the table's columns (the round-trip test holds
# the two together when RunRecord grows a field).
_COLUMNS = tuple(field.name for field in dataclasses.fields(RunRecord))
_COLUMN_LIST = ", ".join(_COLUMNS)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS runs (
        run_id            TEXT PRIMARY KEY,
        model             TEXT NOT NULL,
        provider_id       TEXT NOT NULL,
        target            TEXT NOT NULL,
        operation         TEXT NOT NULL,
        stream            INTEGER NOT NULL,
        outcome           TEXT NOT NULL,
        error_code        TEXT NOT NULL,
        error_message     TEXT NOT NULL,
        received_ms       INTEGER NOT NULL,
        started_ms        INTEGER NOT NULL,
        first_token_ms    INTEGER NOT NULL,
        finished_ms       INTEGER NOT NULL,
        prompt_tokens     INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL
    )""",
    # "recent" walks this backwards; run_id breaks ties in the same millisecond.
    "CREATE INDEX IF NOT EXISTS runs_received ON runs (received_ms, run_id)",
    # Partial: stays tiny however long the history grows, so the sweep at open is cheap.
    "CREATE INDEX IF NOT EXISTS runs_running ON runs (run_id) WHERE outcome = 'running'",
)
"""Statement by statement, not ``executescript``: that would commit the open transaction."""

# A finished row is never turned back into a running one: a late or repeated
# start must not undo the completion that is already on disk.
_UPSERT = (
    f"INSERT INTO runs ({_COLUMN_LIST}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (run_id) DO UPDATE SET "
    + ", ".join(f"{column} = excluded.{column}" for column in _COLUMNS[1:])
    + f" WHERE runs.outcome = '{RUNNING}' OR excluded.outcome <> '{RUNNING}'"
)

BUSY_TIMEOUT_S = 5.0
"""How long one write waits for another connection's write lock before it fails and is retried."""

MAX_RETRY_DELAY_S = 30.0
"""The longest pause between two attempts while the database keeps refusing writes."""


class HistoryError(NodeError):
    """The run history cannot be used (a schema from a newer node, a stopped writer)."""


class HistoryClosed(HistoryError, RuntimeError):
    """The history was used after ``aclose()``."""


def _row(record: RunRecord) -> tuple[object, ...]:
    return tuple(getattr(record, column) for column in _COLUMNS)  # a bool binds as 0/1


def _record(row: Iterable[object]) -> RunRecord:
    values: dict[str, Any] = dict(zip(_COLUMNS, row, strict=True))
    values["stream"] = bool(values["stream"])
    return RunRecord(**values)


def _supersedes(new: RunRecord, old: RunRecord) -> bool:
    """Whether ``new`` may replace ``old``: anything may, except a start replacing an end."""
    return new.outcome != RUNNING or old.outcome == RUNNING


def _newest_first(record: RunRecord) -> tuple[int, str]:
    return (record.received_ms, record.run_id)


def _unix_ms() -> int:
    return int(time.time() * 1000)


def _prepare_file(path: Path) -> None:
    """Create the directory and an owner-only file: error messages may quote provider output.

    SQLite gives its -wal and -shm files the database file's permissions, so
    this one ``touch`` keeps all three private.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.touch(mode=0o600, exist_ok=True)


class SqliteRunHistory:
    """A ``RunHistory`` on one aiosqlite connection; make it with ``await open(path)``.

    ``writes`` counts committed batches, ``failed_writes`` failed attempts (each
    logged and retried) and ``dropped`` records given up to bound memory while
    the database refused writes; they are plain counters for tests and metrics.
    """

    def __init__(
        self,
        db: aiosqlite.Connection,
        path: Path,
        *,
        flush_interval_s: float,
        max_batch: int,
        max_pending: int,
        retry_delay_s: float,
    ) -> None:
        """Use ``open``; this only wires the state (the writer starts in ``open``)."""
        if flush_interval_s < 0 or retry_delay_s < 0:
            raise ValueError("flush_interval_s and retry_delay_s must not be negative")
        if max_batch < 1 or max_pending < 1:
            raise ValueError("max_batch and max_pending must be at least 1")
        self.path = path
        self.writes = 0
        self.failed_writes = 0
        self.dropped = 0
        self._db = db
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._retry_delay_s = retry_delay_s
        # Ordered oldest first by sequence number: a re-put moves to the end, so the
        # front is always the oldest unwritten change and batches are taken from there.
        self._pending: dict[str, tuple[int, RunRecord]] = {}
        self._in_flight: dict[str, tuple[int, RunRecord]] = {}
        self._seq = 0
        self._durable_seq = 0  # every change up to this number is on disk (or was dropped)
        self._wake = asyncio.Event()  # something is pending
        self._urgent = asyncio.Event()  # a flush waits: skip the coalescing pause
        self._progress = asyncio.Condition()
        self._write_lock = asyncio.Lock()  # one transaction at a time on the shared connection
        self._writer: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        flush_interval_s: float = 0.05,
        max_batch: int = 500,
        max_pending: int = 100_000,
        retry_delay_s: float = 1.0,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> SqliteRunHistory:
        """Open (creating if needed) the history at ``path``; the caller must ``aclose()`` it.

        ``flush_interval_s`` is how long the writer lets records gather after the
        first one arrives, so a burst of runs shares a transaction.
        """
        await asyncio.to_thread(_prepare_file, path)
        # isolation_level=None: autocommit, so transactions are exactly the ones we BEGIN.
        db = await aiosqlite.connect(path, isolation_level=None, timeout=busy_timeout_s)
        try:
            await _set_up(db, path)
            history = cls(
                db,
                path,
                flush_interval_s=flush_interval_s,
                max_batch=max_batch,
                max_pending=max_pending,
                retry_delay_s=retry_delay_s,
            )
            interrupted = await history.mark_interrupted(_unix_ms())
        except BaseException:
            await db.close()
            raise
        if interrupted:
            logger.warning(
                "run history {}: {} run(s) left running by the previous node process "
                "marked failed/{}",
                path,
                interrupted,
                INTERRUPTED_CODE,
            )
        else:
            logger.info("run history {}: opened, no interrupted runs", path)
        history._writer = asyncio.create_task(history._write_forever(), name="run-history-writer")
        return history

    async def run_started(self, record: RunRecord) -> None:
        """Queue the start of a run; returns without waiting for the disk."""
        self._put(record)

    async def complete_run(self, record: RunRecord) -> None:
        """Queue the end of a run (replacing its unwritten start); never waits for the disk."""
        self._put(record)

    async def recent(self, limit: int) -> list[RunRecord]:
        """The ``limit`` most recently received runs, newest first, unwritten ones included."""
        self._check_open()
        if limit <= 0:
            return []
        # Snapshot memory before reading: a batch committed while the query runs
        # is then either in the snapshot or in the rows, never in neither.
        memory = [record for _, record in (*self._in_flight.values(), *self._pending.values())]
        rows = await self._db.execute_fetchall(
            f"SELECT {_COLUMN_LIST} FROM runs ORDER BY received_ms DESC, run_id DESC LIMIT ?",
            (limit,),
        )
        merged: dict[str, RunRecord] = {}
        for record in (*map(_record, rows), *memory):  # oldest knowledge first
            known = merged.get(record.run_id)
            if known is None or _supersedes(record, known):
                merged[record.run_id] = record
        return sorted(merged.values(), key=_newest_first, reverse=True)[:limit]

    async def flush(self) -> None:
        """Wait until everything queued so far is on disk (tests, shutdown).

        If the database refuses writes this waits while the writer retries;
        bound it with ``asyncio.timeout`` where that matters.
        """
        self._check_open()
        await self._drain()

    async def mark_interrupted(self, now_ms: int) -> int:
        """Fail the runs a previous process left ``running``; returns how many.

        Meant for ``open``, before this process starts runs of its own.
        """
        self._check_open()
        async with self._write_lock:
            cursor = await self._db.execute(
                "UPDATE runs SET outcome = 'failed', error_code = ?, error_message = ?, "
                "finished_ms = ? WHERE outcome = ?",
                (INTERRUPTED_CODE, INTERRUPTED_MESSAGE, now_ms, RUNNING),
            )
            changed = cursor.rowcount
            await cursor.close()
        return max(changed, 0)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Write what is pending (for up to ``timeout_s``), stop the writer, close; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(timeout_s):
                await self._drain()
        except TimeoutError:
            logger.error(
                "run history {}: {} run record(s) not written within {}s of shutdown; lost",
                self.path,
                len(self._pending) + len(self._in_flight),
                timeout_s,
            )
        except HistoryError:
            logger.error("run history {}: writer stopped; pending records lost", self.path)
        finally:
            await self._stop_writer()
            await self._db.close()

    # -- internals ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise HistoryClosed(f"run history {self.path} is closed")

    def _put(self, record: RunRecord) -> None:
        self._check_open()
        previous = self._pending.pop(record.run_id, None)
        if previous is not None and not _supersedes(record, previous[1]):
            record = previous[1]
        self._seq += 1
        self._pending[record.run_id] = (self._seq, record)
        if len(self._pending) > self._max_pending:
            self._shed()
        self._wake.set()

    def _shed(self) -> None:
        """Drop a tenth of the pending records, unwritten starts first.

        Reached only when the database has refused writes for a long time. A
        dropped start costs little (its completion, if it comes, is still
        written); completions go only when there are no starts left to drop.
        Dropping in chunks keeps this scan and its log line rare.
        """
        excess = len(self._pending) - self._max_pending
        wanted = max(excess, self._max_pending // 10, 1)
        entries = self._pending.items()
        victims = list(
            itertools.islice((i for i, (_, r) in entries if r.outcome == RUNNING), wanted)
        )
        starts = len(victims)
        if starts < wanted:
            ends = (i for i, (_, r) in entries if r.outcome != RUNNING)
            victims.extend(itertools.islice(ends, wanted - starts))
        for run_id in victims:
            del self._pending[run_id]
        self.dropped += len(victims)
        logger.error(
            "run history {}: {} unwritten records dropped ({} starts, {} completions) to bound "
            "memory; the database has refused writes for a while",
            self.path,
            len(victims),
            starts,
            len(victims) - starts,
        )

    async def _drain(self) -> None:
        """Wait until every change queued before this call is committed."""
        if self._pending:
            target = next(reversed(self._pending.values()))[0]
        elif self._in_flight:
            target = max(seq for seq, _ in self._in_flight.values())
        else:
            return
        self._urgent.set()
        self._wake.set()
        writer = self._writer
        async with self._progress:
            await self._progress.wait_for(
                lambda: self._durable_seq >= target or writer is None or writer.done()
            )
        if self._durable_seq < target:
            raise HistoryError(f"run history {self.path}: the writer has stopped")

    async def _write_forever(self) -> None:
        """The one task that writes: gather, commit a batch, repeat; back off on failure."""
        failures = 0
        while True:
            await self._wake.wait()
            await self._gather()
            while self._pending:
                if await self._write_batch():
                    failures = 0
                    continue
                failures += 1
                delay = min(self._retry_delay_s * 2 ** min(failures - 1, 16), MAX_RETRY_DELAY_S)
                # Not cut short by flush(): a refusing disk must not turn into a busy loop.
                await asyncio.sleep(delay)
            # No await since the loop condition: nothing can have arrived in between.
            self._wake.clear()
            self._urgent.clear()

    async def _gather(self) -> None:
        """Let a burst of records arrive before writing, unless a flush is waiting."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._flush_interval_s):
                await self._urgent.wait()

    async def _write_batch(self) -> bool:
        """Commit the oldest pending records in one transaction; False if that failed."""
        oldest = list(itertools.islice(self._pending, self._max_batch))
        batch = {run_id: self._pending.pop(run_id) for run_id in oldest}
        self._in_flight = batch
        try:
            await self._commit([_row(record) for _, record in batch.values()])
        except asyncio.CancelledError:
            self._restore(batch)
            raise
        except Exception:
            self.failed_writes += 1
            logger.exception(
                "run history {}: writing {} run record(s) failed; keeping them for a retry",
                self.path,
                len(batch),
            )
            self._restore(batch)
            return False
        finally:
            self._in_flight = {}
        self.writes += 1
        self._durable_seq = max(seq for seq, _ in batch.values())
        async with self._progress:
            self._progress.notify_all()
        return True

    async def _commit(self, rows: list[tuple[object, ...]]) -> None:
        async with self._write_lock:
            # IMMEDIATE: take the write lock up front, so a busy database fails here,
            # before any row, and the whole batch is retried as one.
            await self._db.execute("BEGIN IMMEDIATE")
            try:
                await self._db.executemany(_UPSERT, rows)
                await self._db.execute("COMMIT")
            except BaseException:
                # The rollback's own failure (COMMIT may have ended the transaction
                # after all) must not replace the error, least of all a cancellation.
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        await self._db.execute("ROLLBACK")
                raise

    def _restore(self, batch: dict[str, tuple[int, RunRecord]]) -> None:
        """Put a failed batch back in front, unless a newer change of the same run arrived."""
        kept = {
            run_id: entry
            for run_id, entry in batch.items()
            if run_id not in self._pending or not _supersedes(self._pending[run_id][1], entry[1])
        }
        for run_id in kept:
            self._pending.pop(run_id, None)
        self._pending = {**kept, **self._pending}

    async def _stop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.cancel()
        # wait(), not await: the writer's CancelledError must not look like our own.
        await asyncio.wait([writer])
        if not writer.cancelled() and writer.exception() is not None:
            logger.opt(exception=writer.exception()).error(
                "run history {}: writer task failed", self.path
            )
        async with self._progress:
            self._progress.notify_all()  # let any flush() still waiting see the end


async def _set_up(db: aiosqlite.Connection, path: Path) -> None:
    async with db.execute("PRAGMA journal_mode = WAL") as cursor:
        row = await cursor.fetchone()
    mode = str(row[0]).lower() if row is not None else "unknown"
    if mode != "wal":
        raise HistoryError(
            f"{path}: SQLite refused WAL journal mode (got {mode!r}); "
            "put the run history on a local filesystem"
        )
    # NORMAL is safe from corruption under WAL and spares an fsync per batch.
    await db.execute("PRAGMA synchronous = NORMAL")
    await db.execute("BEGIN IMMEDIATE")
    try:
        async with db.execute("PRAGMA user_version") as cursor:
            row = await cursor.fetchone()
        version = int(row[0]) if row is not None else 0
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"{path}: run history schema version {version} is newer than this node "
                f"understands ({SCHEMA_VERSION}); upgrade the node or move the file away"
            )
        if version < SCHEMA_VERSION:
            for statement in _SCHEMA:
                await db.execute(statement)
            await db.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
        await db.execute("COMMIT")
    except BaseException:
        await db.execute("ROLLBACK")
        raise
