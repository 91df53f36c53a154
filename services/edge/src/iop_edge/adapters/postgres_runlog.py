"""The edge's run log on the PostgreSQL store every edge of a fleet shares.

The same queue as the SQLite log (``iop_proto.sqlite.QueuedWriter``): ``record``
only files the record in memory and never awaits, so a request never waits for
the database, up or down; one background task commits what is pending with one
``executemany`` per batch. While PostgreSQL is down that task's commits fail
(``StorageUnavailable``, logged) and are retried with a growing pause, up to
``MAX_RETRY_DELAY_S``; the records wait in memory, at most ``max_pending`` of
them, the oldest dropped past that (``dropped`` counts them, and a line is
logged). Once the server is back, the next retry writes them.

Several edges write one table: a run id is the edge's own (a fresh id per run),
so their rows never collide, and ``recent`` lists every edge's runs.
"""

from __future__ import annotations

from typing import Final

import asyncpg
from loguru import logger

from iop_edge.adapters import runlog_history
from iop_edge.adapters.runlog_usage import SUMS, in_window, usage_rows
from iop_edge.adapters.sqlite_runlog import (
    COLUMNS,
    RunLogClosed,
    RunLogError,
    run_from_row,
    run_row,
)
from iop_edge.domain.history import HistoryRange, HistoryRow
from iop_edge.domain.usage import UsageRow
from iop_edge.ports import EdgeRunRecord
from iop_proto.postgres import apply_migrations, reachable
from iop_proto.sqlite import QueuedWriter, WriterTuning

COMPONENT: Final = "edge-runlog"

STEPS: Final = (
    # 1: the SQLite log's version-4 table. run_id in the "C" collation: byte order, as
    # SQLite's, so runs received in the same millisecond list in the same order.
    """CREATE TABLE edge_runs (
        run_id            TEXT COLLATE "C" PRIMARY KEY,
        model             TEXT NOT NULL,
        provider_id       TEXT NOT NULL,
        node_id           TEXT NOT NULL,
        operation         TEXT NOT NULL,
        stream            BOOLEAN NOT NULL,
        outcome           TEXT NOT NULL,
        status            INTEGER NOT NULL,
        error_code        TEXT NOT NULL,
        received_ms       BIGINT NOT NULL,
        queue_wait_ms     BIGINT NOT NULL,
        ttft_ms           BIGINT NOT NULL,
        duration_ms       BIGINT NOT NULL,
        prompt_tokens     BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        key_id            TEXT NOT NULL DEFAULT '',
        attempts          JSONB NOT NULL DEFAULT '[]',
        cached_tokens     BIGINT NOT NULL DEFAULT 0
    );
    CREATE INDEX edge_runs_received ON edge_runs (received_ms, run_id);
    CREATE INDEX edge_runs_key_received ON edge_runs (key_id, received_ms, run_id);""",
    # 2: the public API of each run (domain.usage.Api); runs recorded before say ''.
    "ALTER TABLE edge_runs ADD COLUMN api TEXT NOT NULL DEFAULT ''",
    # 3: the OpenTelemetry trace of each run (docs/ARCHITECTURE.md#traces); '' untraced.
    "ALTER TABLE edge_runs ADD COLUMN trace_id TEXT NOT NULL DEFAULT ''",
)
"""Versioned steps (``iop_proto.postgres.apply_migrations``); append, never edit."""

_COLUMN_LIST: Final = ", ".join(COLUMNS)
# A run recorded again (a retried batch, a repeated record) keeps the last, as on SQLite.
_UPSERT: Final = (
    f"INSERT INTO edge_runs ({_COLUMN_LIST}) "
    f"VALUES ({', '.join(f'${n}' for n in range(1, len(COLUMNS) + 1))}) "
    "ON CONFLICT (run_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in COLUMNS if c != "run_id")
)
_RECENT: Final = (
    f"SELECT {_COLUMN_LIST} FROM edge_runs ORDER BY received_ms DESC, run_id DESC LIMIT $1"
)
_RECENT_OF_KEY: Final = (
    f"SELECT {_COLUMN_LIST} FROM edge_runs WHERE key_id = $1"
    " ORDER BY received_ms DESC, run_id DESC LIMIT $2"
)

_USAGE: Final = (
    f"SELECT key_id, model, api, {SUMS} FROM edge_runs"
    " WHERE received_ms >= $1 AND NOT (run_id = ANY($2::text[]))"
)
_GROUPED: Final = " GROUP BY key_id, model, api"
HISTORY_QUERY: Final = (  # since, step, until, the unwritten run ids
    f"SELECT (received_ms - $1) / $2, model, provider_id, {runlog_history.SUMS}"
    " FROM edge_runs WHERE received_ms >= $1 AND received_ms < $3"
    " AND NOT (run_id = ANY($4::text[])) GROUP BY 1, 2, 3"
)


class PostgresRunLog(QueuedWriter[EdgeRunRecord]):
    """A ``RunLog`` on a shared asyncpg pool; make it with ``await open(pool)``.

    The pool is the caller's (the edge's stores share it) and outlives the log.
    """

    what = "run log"
    noun = "run record"
    statement = _UPSERT
    error = RunLogError
    closed_error = RunLogClosed

    def __init__(self, pool: asyncpg.Pool, tuning: WriterTuning) -> None:
        """Use ``open``."""
        super().__init__("(PostgreSQL)", tuning)
        self._pool = pool

    @classmethod
    async def open(
        cls,
        pool: asyncpg.Pool,
        *,
        flush_interval_s: float = 0.25,
        max_batch: int = 500,
        max_pending: int = 100_000,
        retry_delay_s: float = 0.5,
    ) -> PostgresRunLog:
        """Bring the table up to date and start the writer; the caller must ``aclose()`` it.

        Raises ``StorageUnavailable`` when the server cannot be reached at start.
        """
        tuning = WriterTuning(flush_interval_s, max_batch, max_pending, retry_delay_s)
        await apply_migrations(pool, COMPONENT, STEPS)
        log = cls(pool, tuning)
        log.start("edge-run-log-writer")
        logger.info("run log: on PostgreSQL")
        return log

    record = QueuedWriter.put
    """Queue one finished run: the writer's ``put``, which never waits for the database."""

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        """The ``limit`` most recently received runs of every edge, newest first, this
        edge's unwritten ones included; only those of ``key_id`` when it is given.

        Raises ``StorageUnavailable`` while the server cannot be reached.
        """
        self.check_open()
        if limit <= 0:
            return []
        # Taken before the query: a batch committed meanwhile is in one of the two.
        memory = [r for r in self.unwritten() if key_id is None or r.key_id == key_id]
        with reachable("reading the run log"):
            if key_id is None:
                rows = await self._pool.fetch(_RECENT, limit)
            else:
                rows = await self._pool.fetch(_RECENT_OF_KEY, key_id, limit)
        merged = self.latest(map(run_from_row, rows), memory)
        return sorted(merged, key=lambda r: (r.received_ms, r.run_id), reverse=True)[:limit]

    async def usage(self, since_ms: int, key_id: str | None = None) -> list[UsageRow]:
        """The runs of every edge received since ``since_ms``, added up by key, model and
        API, this edge's unwritten ones included (``runlog_usage``); only ``key_id``'s
        when it is given. Raises ``StorageUnavailable`` while the server cannot be reached.
        """
        self.check_open()
        memory = in_window(self.unwritten(), since_ms, key_id)
        unwritten = [r.run_id for r in memory]
        with reachable("reading the run log"):
            if key_id is None:
                rows = await self._pool.fetch(_USAGE + _GROUPED, since_ms, unwritten)
            else:
                rows = await self._pool.fetch(
                    _USAGE + " AND key_id = $3" + _GROUPED, since_ms, unwritten, key_id
                )
        return usage_rows(rows, memory)

    async def history(self, span: HistoryRange) -> list[HistoryRow]:
        """The runs of every edge received in ``span``, added up by bucket, model and
        provider, this edge's unwritten ones included (``runlog_history``). Raises
        ``StorageUnavailable`` while the server cannot be reached."""
        self.check_open()
        memory = runlog_history.unwritten_in(self.unwritten(), span)
        unwritten = [r.run_id for r in memory]
        with reachable("reading the run log"):
            rows = await self._pool.fetch(
                HISTORY_QUERY, span.since_ms, span.step_ms, span.until_ms, unwritten
            )
        return runlog_history.history_rows(rows, memory, span)

    async def _commit(self, rows: list[tuple[object, ...]]) -> None:
        with reachable("writing the run log"):
            async with self._pool.acquire() as connection, connection.transaction():
                await connection.executemany(self.statement, rows)

    def _key(self, record: EdgeRunRecord) -> str:
        return record.run_id

    _row = staticmethod(run_row)  # the row SQLite's run log writes too
