"""Run history in one SQLite file, written by one background task in batches.

The request path must never wait for a disk: ``run_started`` and
``complete_run`` (both ``put``) only queue the record in memory, keyed by run id
(``iop_proto.sqlite.BatchedWriter``, the edge's run log's writer too), and the
writer commits whatever is pending in one transaction per batch. A short run
whose completion arrives before its start was written costs one row write.

Durability is traded knowingly: records still in memory when the process is
killed are lost, and ``synchronous = NORMAL`` under WAL may lose the last
commits on power loss (never corrupting the file). A run whose start reached
the disk but whose end did not is turned into ``failed``/``interrupted`` by the
next ``open``, so a crash leaves a visible trace rather than a run that
"runs" forever.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loguru import logger

from iop_node.errors import NodeError
from iop_node.ports import RunRecord
from iop_proto.sqlite import BatchedWriter, WriterTuning, open_database, statement_migrations

SCHEMA_VERSION = 2
"""Kept in ``PRAGMA user_version``; bump it with a migration when the table changes."""

RUNNING = "running"
INTERRUPTED_CODE = "interrupted"
INTERRUPTED_MESSAGE = "node stopped before the run finished"

# The record's fields, in order, are the table's columns (the round-trip test holds
# the two together when RunRecord grows a field).
_COLUMNS = tuple(field.name for field in dataclasses.fields(RunRecord))
_COLUMN_LIST = ", ".join(_COLUMNS)
_READ_COLUMNS = operator.attrgetter(*_COLUMNS)

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
        completion_tokens INTEGER NOT NULL,
        cached_tokens     INTEGER NOT NULL DEFAULT 0
    )""",
    # "recent" walks this backwards; run_id breaks ties in the same millisecond.
    "CREATE INDEX IF NOT EXISTS runs_received ON runs (received_ms, run_id)",
    # Partial: stays tiny however long the history grows, so the sweep at open is cheap.
    "CREATE INDEX IF NOT EXISTS runs_running ON runs (run_id) WHERE outcome = 'running'",
)
"""Statement by statement, not ``executescript``: that would commit the open transaction."""

_MIGRATIONS = {
    # 1 -> 2: the prompt tokens the engine served from its cache; runs recorded before
    # say 0 (unknown then)
    1: ("ALTER TABLE runs ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0",),
}

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


class HistoryError(NodeError):
    """The run history cannot be used (a schema from a newer node, a stopped writer)."""


class HistoryClosed(HistoryError, RuntimeError):
    """The history was used after ``aclose()``."""


def _record(row: Iterable[object]) -> RunRecord:
    values: dict[str, Any] = dict(zip(_COLUMNS, row, strict=True))
    values["stream"] = bool(values["stream"])
    return RunRecord(**values)


def _unix_ms() -> int:
    return time.time_ns() // 1_000_000  # as the executor's clock


class SqliteRunHistory(BatchedWriter[RunRecord]):
    """A ``RunHistory`` on one aiosqlite connection; make it with ``await open(path)``."""

    what = "run history"
    noun = "run record"
    statement = _UPSERT
    error = HistoryError
    closed_error = HistoryClosed

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
        """Open (creating if needed) the history at ``path``, failing the runs a previous
        process left running; the caller must ``aclose()`` it (tuning: ``WriterTuning``).
        """
        tuning = WriterTuning(flush_interval_s, max_batch, max_pending, retry_delay_s)
        # NORMAL is safe from corruption under WAL and spares an fsync per batch.
        db = await open_database(
            path,
            busy_timeout_s=busy_timeout_s,
            what="run history",
            owner="node",
            schema=_SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="NORMAL",
            error=HistoryError,
            migrate=statement_migrations(_MIGRATIONS, SCHEMA_VERSION),
        )
        history = cls(db, path, tuning)
        try:
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
        history.start("run-history-writer")
        return history

    # A run's start, or its end (replacing its unwritten start), is queued, not waited
    # for; a start and an end are queued alike, told apart by ``outcome`` (``_supersedes``).
    run_started = BatchedWriter.put
    complete_run = BatchedWriter.put

    async def recent(self, limit: int) -> list[RunRecord]:
        """The ``limit`` most recently received runs, newest first, unwritten ones included."""
        self.check_open()
        if limit <= 0:
            return []
        memory = self.unwritten()
        rows = await self._db.execute_fetchall(
            f"SELECT {_COLUMN_LIST} FROM runs ORDER BY received_ms DESC, run_id DESC LIMIT ?",
            (limit,),
        )
        merged = self.latest(map(_record, rows), memory)
        return sorted(merged, key=lambda r: (r.received_ms, r.run_id), reverse=True)[:limit]

    async def mark_interrupted(self, now_ms: int) -> int:
        """Fail the runs a previous process left ``running``; returns how many.

        Meant for ``open``, before this process starts runs of its own.
        """
        self.check_open()
        async with self._write_lock:
            cursor = await self._db.execute(
                "UPDATE runs SET outcome = 'failed', error_code = ?, error_message = ?, "
                "finished_ms = ? WHERE outcome = ?",
                (INTERRUPTED_CODE, INTERRUPTED_MESSAGE, now_ms, RUNNING),
            )
            changed = cursor.rowcount
            await cursor.close()
        return max(changed, 0)

    # A record is known by its run id; its row is every column at once (a bool binds as
    # 0/1). Both are attribute getters standing for the methods, which mypy cannot type.
    _key = staticmethod(operator.attrgetter("run_id"))  # type: ignore[assignment]
    _row = staticmethod(_READ_COLUMNS)  # type: ignore[assignment]

    def _supersedes(self, new: RunRecord, old: RunRecord) -> bool:
        """Anything may replace a record, except a start replacing an end."""
        return new.outcome != RUNNING or old.outcome == RUNNING

    def _shed_first(self, record: RunRecord) -> bool:
        # A dropped start costs little: its completion, if it comes, is still written.
        return record.outcome == RUNNING

    def _shed_note(self, victims: list[RunRecord]) -> str:
        starts = sum(record.outcome == RUNNING for record in victims)
        return (
            f"{len(victims)} unwritten records dropped "
            f"({starts} starts, {len(victims) - starts} completions)"
        )
