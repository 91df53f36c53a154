"""The edge's run log in one SQLite file, written by one background task in batches.

A request must never wait for a disk: ``record`` only appends to an in-memory
list and wakes the writer, which commits what is pending in one transaction
per batch. The edge records each run once, when it ends, so a first-in
first-out list is enough (the node's history merges a run's start and end).

Durability is traded knowingly: records still in memory when the process is
killed are lost, and ``synchronous = NORMAL`` under WAL may lose the last
commits on power loss (never corrupting the file).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiosqlite
from loguru import logger

from iop_edge.adapters.sqlite_file import open_database, transaction
from iop_edge.ports import EdgeRunRecord

SCHEMA_VERSION = 2
"""Kept in ``PRAGMA user_version``; bump it with a migration when the table changes."""

# The record's fields, in order, are the table's columns (the round-trip test holds
# the two together when EdgeRunRecord grows a field).
_COLUMNS = tuple(field.name for field in dataclasses.fields(EdgeRunRecord))
_COLUMN_LIST = ", ".join(_COLUMNS)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS runs (
        run_id            TEXT PRIMARY KEY,
        model             TEXT NOT NULL,
        provider_id       TEXT NOT NULL,
        node_id           TEXT NOT NULL,
        operation         TEXT NOT NULL,
        stream            INTEGER NOT NULL,
        outcome           TEXT NOT NULL,
        status            INTEGER NOT NULL,
        error_code        TEXT NOT NULL,
        received_ms       INTEGER NOT NULL,
        queue_wait_ms     INTEGER NOT NULL,
        ttft_ms           INTEGER NOT NULL,
        duration_ms       INTEGER NOT NULL,
        prompt_tokens     INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        key_id            TEXT NOT NULL DEFAULT ''
    )""",
    # "recent" walks this backwards; run_id breaks ties in the same millisecond.
    "CREATE INDEX IF NOT EXISTS runs_received ON runs (received_ms, run_id)",
    # ... and this one for one key's runs (a key sees only its own)
    "CREATE INDEX IF NOT EXISTS runs_key_received ON runs (key_id, received_ms, run_id)",
)
"""Statement by statement, not ``executescript``: that would commit the open transaction."""

_MIGRATIONS = {
    # 1 -> 2: the key of each run; runs recorded before are nobody's (operators see them)
    1: ("ALTER TABLE runs ADD COLUMN key_id TEXT NOT NULL DEFAULT ''",),
}


async def _migrate(db: aiosqlite.Connection, version: int) -> None:
    """Each step from ``version`` up, in the open transaction (``open_database``'s hook)."""
    for step in range(version, SCHEMA_VERSION):
        for statement in _MIGRATIONS.get(step, ()):
            await db.execute(statement)


# REPLACE: a run id recorded twice (a retried write, a repeated record) keeps the last.
_INSERT = f"INSERT OR REPLACE INTO runs ({_COLUMN_LIST}) VALUES ({', '.join('?' * len(_COLUMNS))})"

BUSY_TIMEOUT_S = 5.0  # how long one write waits for another connection's lock, then fails
MAX_RETRY_DELAY_S = 30.0  # the longest pause between attempts while writes keep failing


class RunLogError(Exception):
    """The run log cannot be used (a schema from a newer edge, a stopped writer)."""


class RunLogClosed(RunLogError, RuntimeError):
    """The run log was used after ``aclose()``."""


def _row(record: EdgeRunRecord) -> tuple[object, ...]:
    return tuple(getattr(record, column) for column in _COLUMNS)  # a bool binds as 0/1


def _record(row: Iterable[object]) -> EdgeRunRecord:
    values: dict[str, Any] = dict(zip(_COLUMNS, row, strict=True))
    values["stream"] = bool(values["stream"])
    return EdgeRunRecord(**values)


class SqliteRunLog:
    """A ``RunLog`` on one aiosqlite connection; make it with ``await open(path)``.

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
        # (sequence number, record), oldest first. The writer's batch stays at the
        # front until it is committed, so pending[0] is always the oldest unwritten.
        self._pending: deque[tuple[int, EdgeRunRecord]] = deque()
        self._writing = 0  # the batch being committed: the first this many of _pending
        self._seq = 0
        self._wake = asyncio.Event()  # something is pending
        self._urgent = asyncio.Event()  # a flush waits: skip the coalescing pause
        self._progress = asyncio.Event()  # set (and replaced) when flushes should look again
        self._writer: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        flush_interval_s: float = 0.25,
        max_batch: int = 500,
        max_pending: int = 100_000,
        retry_delay_s: float = 0.5,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> SqliteRunLog:
        """Open (creating if needed) the log at ``path``; the caller must ``aclose()`` it.

        ``flush_interval_s`` is how long the writer lets records gather after the
        first one arrives, so a burst of runs shares a transaction.
        """
        # NORMAL is safe from corruption under WAL and spares an fsync per batch.
        db = await open_database(
            path,
            busy_timeout_s=busy_timeout_s,
            what="run log",
            schema=_SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="NORMAL",
            error=RunLogError,
            migrate=_migrate,
        )
        try:
            log = cls(
                db,
                path,
                flush_interval_s=flush_interval_s,
                max_batch=max_batch,
                max_pending=max_pending,
                retry_delay_s=retry_delay_s,
            )
        except BaseException:
            await db.close()
            raise
        log._writer = asyncio.create_task(log._write_forever(), name="edge-run-log-writer")
        logger.info("run log {}: opened", path)
        return log

    async def record(self, run: EdgeRunRecord) -> None:
        """Queue one finished run; returns without waiting for the disk (never suspends)."""
        self._check_open()
        self._seq += 1
        self._pending.append((self._seq, run))
        if len(self._pending) > self._max_pending:
            self._shed()
        self._wake.set()

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        """The ``limit`` most recently received runs, newest first, unwritten ones included;
        only those of ``key_id`` when it is given."""
        self._check_open()
        if limit <= 0:
            return []
        # Snapshot memory before reading: a batch committed while the query runs
        # is then either in the snapshot or in the rows, never in neither.
        memory = [r for _, r in self._pending if key_id is None or r.key_id == key_id]
        if key_id is None:
            query = (
                f"SELECT {_COLUMN_LIST} FROM runs ORDER BY received_ms DESC, run_id DESC LIMIT ?"
            )
            parameters: tuple[object, ...] = (limit,)
        else:
            query = (
                f"SELECT {_COLUMN_LIST} FROM runs WHERE key_id = ?"
                " ORDER BY received_ms DESC, run_id DESC LIMIT ?"
            )
            parameters = (key_id, limit)
        rows = await self._db.execute_fetchall(query, parameters)
        # Oldest knowledge first, so a run recorded again in memory replaces its row.
        merged = {record.run_id: record for record in (*map(_record, rows), *memory)}
        newest_first = sorted(merged.values(), key=lambda r: (r.received_ms, r.run_id))[::-1]
        return newest_first[:limit]

    async def flush(self) -> None:
        """Wait until everything recorded before this call is on disk (tests, shutdown).

        While the database refuses writes this waits for the writer's retries;
        bound it with ``asyncio.timeout`` where that matters.
        """
        self._check_open()
        await self._drain()

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
                "run log {}: {} run record(s) not written within {}s of shutdown; lost",
                self.path,
                len(self._pending),
                timeout_s,
            )
        finally:
            await self._stop_writer()
            await self._db.close()

    # -- internals ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RunLogClosed(f"run log {self.path} is closed")

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _shed(self) -> None:
        """Drop the oldest records not being written, a tenth at a time (rare log lines)."""
        count = max(len(self._pending) - self._max_pending, self._max_pending // 10, 1)
        count = min(count, len(self._pending) - self._writing)
        self._pending.rotate(-self._writing)  # the batch in flight is not ours to drop
        for _ in range(count):
            self._pending.popleft()
        self._pending.rotate(self._writing)
        self.dropped += count
        logger.error(
            "run log {}: {} unwritten run record(s) dropped to bound memory; "
            "the database has refused writes for a while",
            self.path,
            count,
        )
        self._notify()

    async def _drain(self) -> None:
        """Wait until every record queued before this call is written (or dropped)."""
        target = self._seq
        while self._pending and self._pending[0][0] <= target:
            if self._writer is None or self._writer.done():
                error = RunLogClosed if self._closed else RunLogError
                raise error(f"run log {self.path}: the writer has stopped")
            self._urgent.set()
            self._wake.set()
            await self._progress.wait()

    async def _write_forever(self) -> None:
        """The one task that writes: gather, commit a batch, repeat; back off on failure."""
        failures = 0
        while True:
            await self._wake.wait()
            # Let a burst of records arrive before writing, unless a flush is waiting.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._flush_interval_s):
                    await self._urgent.wait()
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

    async def _write_batch(self) -> bool:
        """Commit the oldest pending records in one transaction; False if that failed."""
        self._writing = min(len(self._pending), self._max_batch)
        rows = [_row(record) for _, record in itertools.islice(self._pending, self._writing)]
        try:
            async with transaction(self._db):
                await self._db.executemany(_INSERT, rows)
        except Exception:
            self.failed_writes += 1
            logger.exception(
                "run log {}: writing {} run record(s) failed; keeping them for a retry",
                self.path,
                len(rows),
            )
            return False
        else:
            for _ in range(self._writing):
                self._pending.popleft()
            self.writes += 1
            self._notify()
            return True
        finally:
            self._writing = 0

    async def _stop_writer(self) -> None:
        """Cancel the writer, say if it had failed, and let any waiting flush see the end."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()
            # wait(), not await: the writer's CancelledError must not look like our own.
            await asyncio.wait([writer])
            if not writer.cancelled() and writer.exception() is not None:
                logger.opt(exception=writer.exception()).error(
                    "run log {}: writer task failed", self.path
                )
        self._notify()
