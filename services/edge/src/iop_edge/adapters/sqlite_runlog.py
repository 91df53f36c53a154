"""The edge's run log in one SQLite file, written by one background task in batches.

A request must never wait for a disk: ``record`` only queues the record in
memory (``iop_proto.sqlite.BatchedWriter``, the node's run history's writer too),
which commits what is pending in one transaction per batch. The edge records
each run once, when it ends: a run recorded again replaces the first.

Durability is traded knowingly: records still in memory when the process is
killed are lost, and ``synchronous = NORMAL`` under WAL may lose the last
commits on power loss (never corrupting the file).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loguru import logger

from iop_edge.adapters import runlog_history
from iop_edge.adapters.runlog_usage import SUMS, in_window, usage_rows
from iop_edge.domain.history import HistoryRange, HistoryRow
from iop_edge.domain.usage import UsageRow
from iop_edge.ports import AttemptRecord, EdgeRunRecord
from iop_proto import json_codec
from iop_proto.sqlite import BatchedWriter, WriterTuning, open_database, statement_migrations

SCHEMA_VERSION = 6
"""Kept in ``PRAGMA user_version``; bump it with a migration when the table changes."""

# The record's fields, in order, are the table's columns (the round-trip test holds
# the two together when EdgeRunRecord grows a field).
COLUMNS = tuple(field.name for field in dataclasses.fields(EdgeRunRecord))
_COLUMN_LIST = ", ".join(COLUMNS)
_READ_COLUMNS = operator.attrgetter(*COLUMNS)
_ATTEMPTS = COLUMNS.index("attempts")

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
        key_id            TEXT NOT NULL DEFAULT '',
        attempts          TEXT NOT NULL DEFAULT '[]',
        cached_tokens     INTEGER NOT NULL DEFAULT 0,
        api               TEXT NOT NULL DEFAULT '',
        trace_id          TEXT NOT NULL DEFAULT ''
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
    # 2 -> 3: every attempt of a run, as JSON (docs/ARCHITECTURE.md#failover); runs
    # recorded before list none
    2: ("ALTER TABLE runs ADD COLUMN attempts TEXT NOT NULL DEFAULT '[]'",),
    # 3 -> 4: the prompt tokens the engine served from its cache; runs recorded before
    # say 0 (unknown then)
    3: ("ALTER TABLE runs ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0",),
    # 4 -> 5: the public API of each run (domain.usage.Api); runs recorded before say ''
    # (their operation cannot tell a Responses or Messages run from a chat completion)
    4: ("ALTER TABLE runs ADD COLUMN api TEXT NOT NULL DEFAULT ''",),
    # 5 -> 6: the OpenTelemetry trace id of each run (docs/ARCHITECTURE.md#traces), which
    # joins the run to its spans in a receiver; '' for a run not traced (tracing off)
    5: ("ALTER TABLE runs ADD COLUMN trace_id TEXT NOT NULL DEFAULT ''",),
}


# REPLACE: a run id recorded twice (a retried write, a repeated record) keeps the last.
_INSERT = f"INSERT OR REPLACE INTO runs ({_COLUMN_LIST}) VALUES ({', '.join('?' * len(COLUMNS))})"

# since, step, since, until, the unwritten run ids (JSON): a range on runs_received.
HISTORY_QUERY = (
    f"SELECT (received_ms - ?) / ?, model, provider_id, {runlog_history.SUMS}"
    " FROM runs WHERE received_ms >= ? AND received_ms < ?"
    " AND run_id NOT IN (SELECT value FROM json_each(?)) GROUP BY 1, 2, 3"
)

BUSY_TIMEOUT_S = 5.0  # how long one write waits for another connection's lock, then fails


class RunLogError(Exception):
    """The run log cannot be used (a schema from a newer edge, a stopped writer)."""


class RunLogClosed(RunLogError, RuntimeError):
    """The run log was used after ``aclose()``."""


def run_from_row(row: Iterable[object]) -> EdgeRunRecord:
    """A row of the ``runs`` table (SQLite's or PostgreSQL's) as the record it holds."""
    values: dict[str, Any] = dict(zip(COLUMNS, row, strict=True))
    values["stream"] = bool(values["stream"])
    values["attempts"] = tuple(AttemptRecord(**a) for a in json_codec.loads(values["attempts"]))
    return EdgeRunRecord(**values)


def run_row(record: EdgeRunRecord) -> tuple[object, ...]:
    """The record's fields in the table's order (a bool binds as SQLite's 0/1 or
    PostgreSQL's boolean); the attempts are JSON text, each with the fields of
    ``AttemptRecord``."""
    row = list(_READ_COLUMNS(record))
    row[_ATTEMPTS] = json_codec.dumps(
        [
            {
                "run_id": a.run_id,
                "provider_id": a.provider_id,
                "node_id": a.node_id,
                "outcome": a.outcome,
                "error_code": a.error_code,
                "started_ms": a.started_ms,
                "duration_ms": a.duration_ms,
            }
            for a in record.attempts
        ]
    ).decode()
    return tuple(row)


class SqliteRunLog(BatchedWriter[EdgeRunRecord]):
    """A ``RunLog`` on one aiosqlite connection; make it with ``await open(path)``."""

    what = "run log"
    noun = "run record"
    statement = _INSERT
    error = RunLogError
    closed_error = RunLogClosed

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

        The four tuning arguments are ``WriterTuning``'s, checked before the file opens.
        """
        tuning = WriterTuning(flush_interval_s, max_batch, max_pending, retry_delay_s)
        # NORMAL is safe from corruption under WAL and spares an fsync per batch.
        db = await open_database(
            path,
            busy_timeout_s=busy_timeout_s,
            what="run log",
            owner="edge",
            schema=_SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="NORMAL",
            error=RunLogError,
            migrate=statement_migrations(_MIGRATIONS, SCHEMA_VERSION),
        )
        log = cls(db, path, tuning)
        log.start("edge-run-log-writer")
        logger.info("run log {}: opened", path)
        return log

    record = BatchedWriter.put
    """Queue one finished run: the writer's ``put``, which never waits for the disk."""

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        """The ``limit`` most recently received runs, newest first, unwritten ones included;
        only those of ``key_id`` when it is given."""
        self.check_open()
        if limit <= 0:
            return []
        memory = [r for r in self.unwritten() if key_id is None or r.key_id == key_id]
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
        merged = self.latest(map(run_from_row, rows), memory)
        return sorted(merged, key=lambda r: (r.received_ms, r.run_id), reverse=True)[:limit]

    async def usage(self, since_ms: int, key_id: str | None = None) -> list[UsageRow]:
        """The runs received since ``since_ms``, added up by key, model and API, unwritten
        ones included (``runlog_usage``); only ``key_id``'s when it is given."""
        self.check_open()
        memory = in_window(self.unwritten(), since_ms, key_id)
        unwritten = json_codec.dumps([r.run_id for r in memory]).decode()
        query = (
            f"SELECT key_id, model, api, {SUMS} FROM runs WHERE received_ms >= ?"
            + ("" if key_id is None else " AND key_id = ?")
            + " AND run_id NOT IN (SELECT value FROM json_each(?)) GROUP BY key_id, model, api"
        )
        parameters = (since_ms, unwritten) if key_id is None else (since_ms, key_id, unwritten)
        rows = await self._db.execute_fetchall(query, parameters)
        return usage_rows(rows, memory)

    async def history(self, span: HistoryRange) -> list[HistoryRow]:
        """The runs received in ``span``, added up by bucket, model and provider,
        unwritten ones included (``runlog_history``)."""
        self.check_open()
        memory = runlog_history.unwritten_in(self.unwritten(), span)
        unwritten = json_codec.dumps([r.run_id for r in memory]).decode()
        parameters = (span.since_ms, span.step_ms, span.since_ms, span.until_ms, unwritten)
        rows = await self._db.execute_fetchall(HISTORY_QUERY, parameters)
        return runlog_history.history_rows(rows, memory, span)

    # a record is known by its run id (an attribute getter for the method: mypy cannot type it)
    _key = staticmethod(operator.attrgetter("run_id"))  # type: ignore[assignment]

    _row = staticmethod(run_row)  # the row PostgreSQL's run log writes too
