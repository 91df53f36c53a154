"""Files, batches, leases and line results in PostgreSQL: the ``BatchStore`` every edge of a
fleet shares (``SqliteBatchStore`` is one edge's own).

Each method is one statement or one transaction on a pooled connection, so
two edges calling at once see each other's commits and never half of them.
Where two edges may race, the write is conditional on the state it was
decided from, and PostgreSQL's row locks make the second wait and re-check
(READ COMMITTED re-evaluates an ``UPDATE``'s ``WHERE`` on the row the first
committed): ``set_lease`` takes a batch only while its lease is free or
expired, ``extend_lease``/``free_lease`` act only for the lease that holds it,
``begin_finalize`` freezes once, ``end_batch`` ends once, and ``finish_line``
stores a line only while it is pending, under a share lock on its batch row
so that a freeze waits for the lines being stored and none lands after it.
A lease is a row with an expiry, not a connection or a process: it outlives
the edge that granted it, and any edge may grant the batch again once it
expires.

An unreachable server is ``StorageUnavailable`` (``reachable``): the storage
APIs answer a retryable 503, and what committed before is still there after.
File contents are chunk rows, streamed both ways (``pg_batch_files``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

import asyncpg
from loguru import logger

from iop_edge.adapters.batch_rows import (
    RUNNABLE_SQL,
    TIMESTAMP_OF,
    UNENDED_SQL,
    batch_record,
    batch_select,
    file_row,
    json_text,
    line_record,
    new_line_row,
)
from iop_edge.adapters.pg_batch_files import INSERT_FILE, LENT, purge_contents, write_content
from iop_edge.adapters.pg_batch_schema import COMPONENT, STEPS
from iop_edge.adapters.pg_file_store import PgFileStore, count_of
from iop_edge.domain.batches import (
    CANCELLING,
    COMPLETED,
    FINALIZING,
    IN_PROGRESS,
    PENDING,
    STATUSES,
    BatchRecord,
    FileRecord,
    InputLine,
    LineRecord,
    LineResult,
)
from iop_proto.postgres import apply_migrations

BATCH_SELECT: Final = batch_select("edge_batches", "edge_batch_lines")
LINE_COLUMNS: Final = (
    "batch_id, line_number, custom_id, body, state, status_code, response, error, "
    "request_id, result_id"
)
LEASE_FREE: Final = "(b.lease_expires_at IS NULL OR b.lease_expires_at <= $1)"
INSERT_BLOCK: Final = 500
"""Lines read (off the loop) and inserted per round trip while a batch is stored."""


def _take(lines: Iterator[InputLine], count: int) -> list[InputLine]:
    return list(itertools.islice(lines, count))


class PostgresBatchStore(PgFileStore):
    """Make it with ``await PostgresBatchStore.open(pool)``; the caller must ``aclose()`` it
    (the pool is the caller's, and outlives the store)."""

    edge_id = "edge"

    @classmethod
    async def open(
        cls,
        pool: asyncpg.Pool,
        *,
        file_ttl_s: int = 0,
        sweep_interval_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        edge_id: str = "edge",
    ) -> PostgresBatchStore:
        """Bring the schema up to date and remove what crashes left (dead uploads,
        deleted contents past their grace); then sweep every ``sweep_interval_s``.
        ``edge_id``: this edge's ``service_id``, recorded with the leases it grants
        (each edge sharing the store needs its own)."""
        version = await apply_migrations(pool, COMPONENT, STEPS)
        store = cls(pool, file_ttl_s, clock)
        store.edge_id = edge_id
        purged = await purge_contents(pool, clock())
        logger.info(
            "batch store: PostgreSQL, schema {}; {} stale contents removed", version, purged
        )
        store._sweeper = asyncio.create_task(
            store._sweep_forever(sweep_interval_s), name="edge-file-sweep"
        )
        return store

    # -- batches -------------------------------------------------------------

    async def insert_batch(
        self,
        batch: BatchRecord,
        lines: Iterable[InputLine],
        results: Mapping[int, LineResult] | None = None,
    ) -> None:
        """The batch and all its lines in one transaction; ``lines`` is read a block at a
        time in a thread. It may read a stored file: its reader then fetches the chunks
        through this transaction's connection (lent for the wait), so storing a batch
        takes one connection however many are stored at once."""
        done = results or {}
        source = iter(lines)
        async with self._transaction("storing a batch") as connection:
            await connection.execute(
                """INSERT INTO edge_batches (id, input_file_id, endpoint, completion_window,
                    metadata, status, created_at, failed_at, expires_at, errors, total_lines,
                    owner)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)""",
                batch.id,
                batch.input_file_id,
                batch.endpoint,
                batch.completion_window,
                json_text(batch.metadata),
                batch.status,
                batch.created_at,
                batch.failed_at,
                batch.expires_at,
                json_text(batch.errors),
                batch.total,
                batch.owner,
            )
            lent = LENT.set(connection)  # the reader's chunks come through this transaction
            try:
                while block := await asyncio.to_thread(_take, source, INSERT_BLOCK):
                    await connection.executemany(
                        f"INSERT INTO edge_batch_lines ({LINE_COLUMNS}, finished_at) "
                        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                        [new_line_row(batch, line, done.get(line.index)) for line in block],
                    )
            finally:
                LENT.reset(lent)

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        rows = await self._fetch("reading a batch", f"{BATCH_SELECT} WHERE b.id = $1", batch_id)
        return batch_record(rows[0]) if rows else None

    async def list_batches(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> list[BatchRecord]:
        params: list[Any] = []
        where: list[str] = []
        if owner is not None:
            params.append(owner)
            where.append(f"b.owner = ${len(params)}")
        if after is not None:  # a cursor of another owner's is no cursor: existence stays hidden
            params.append(after)
            mine = "" if owner is None else " AND owner = $1"
            where.append(f"b.seq < (SELECT seq FROM edge_batches WHERE id = ${len(params)}{mine})")
        params.append(limit)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        sql = f"{BATCH_SELECT} {clause} ORDER BY b.seq DESC LIMIT ${len(params)}"
        return [batch_record(row) for row in await self._fetch("listing batches", sql, *params)]

    async def batch_by_lease(self, lease_id: str) -> BatchRecord | None:
        rows = await self._fetch(
            "reading a lease", f"{BATCH_SELECT} WHERE b.lease_id = $1", lease_id
        )
        return batch_record(rows[0]) if rows else None

    async def leasable(self, now: float) -> BatchRecord | None:
        rows = await self._fetch(
            "finding a batch to lease",
            f"""{BATCH_SELECT} WHERE b.status IN ({RUNNABLE_SQL}) AND b.finalize_as IS NULL
            AND {LEASE_FREE} ORDER BY b.seq LIMIT 1""",
            now,
        )
        return batch_record(rows[0]) if rows else None

    async def to_finalize(self, now: float) -> list[BatchRecord]:
        rows = await self._fetch(
            "finding batches to end",
            f"""{BATCH_SELECT} WHERE b.finalize_as IS NOT NULL
            OR (b.status = '{CANCELLING}' AND {LEASE_FREE})
            OR (b.status IN ({RUNNABLE_SQL}) AND b.expires_at <= $1 AND {LEASE_FREE})
            ORDER BY b.seq""",
            now,
        )
        return [batch_record(row) for row in rows]

    async def owned_unended(self) -> list[tuple[str, str]]:
        rows = await self._fetch(
            "finding owned batches",
            f"""SELECT id, owner FROM edge_batches WHERE owner IS NOT NULL
            AND finalize_as IS NULL AND status IN ({UNENDED_SQL}) ORDER BY seq""",
        )
        return [(str(batch_id), str(owner)) for batch_id, owner in rows]

    async def status_counts(self) -> dict[str, int]:
        rows = await self._fetch(
            "counting batches", "SELECT status, COUNT(*) FROM edge_batches GROUP BY status"
        )
        counts = dict.fromkeys(STATUSES, 0)
        counts.update({str(status): int(count) for status, count in rows})
        return counts

    async def set_lease(
        self, batch_id: str, lease_id: str, owner: str, expires_at: float, now: float
    ) -> bool:
        return (
            await self._execute(
                "leasing a batch",
                f"""UPDATE edge_batches b SET lease_id = $2, lease_owner = $3, lease_edge = $7,
                lease_expires_at = $4, status = '{IN_PROGRESS}',
                in_progress_at = COALESCE(in_progress_at, $5)
            WHERE id = $6 AND status IN ({RUNNABLE_SQL}) AND finalize_as IS NULL
            AND {LEASE_FREE}""",
                now,
                lease_id,
                owner,
                expires_at,
                int(now),
                batch_id,
                self.edge_id,
            )
            == 1
        )

    async def extend_lease(self, batch_id: str, lease_id: str, expires_at: float) -> bool:
        return (
            await self._execute(
                "renewing a lease",
                "UPDATE edge_batches SET lease_expires_at = $1 WHERE id = $2 AND lease_id = $3",
                expires_at,
                batch_id,
                lease_id,
            )
            == 1
        )

    async def free_lease(
        self, batch_id: str, lease_id: str, not_before: float | None = None
    ) -> None:
        await self._execute(
            "freeing a lease",
            """UPDATE edge_batches SET lease_id = NULL, lease_owner = NULL, lease_expires_at = $1
            WHERE id = $2 AND lease_id = $3""",
            not_before,
            batch_id,
            lease_id,
        )

    async def free_leases_of(self, owner: str) -> int:
        """Free the leases this edge granted ``owner``: they died with its connections to
        this edge. Leases another edge granted it stay that edge's to free (the worker
        may be connected there still), or expire."""
        return await self._execute(
            "freeing a worker's leases",
            """UPDATE edge_batches SET lease_id = NULL, lease_owner = NULL,
                lease_expires_at = NULL
            WHERE lease_owner = $1 AND lease_edge = $2""",
            owner,
            self.edge_id,
        )

    async def mark_cancelling(self, batch_id: str, now: int) -> None:
        await self._execute(
            "cancelling a batch",
            f"""UPDATE edge_batches SET status = '{CANCELLING}', cancelling_at = $1
            WHERE id = $2 AND finalize_as IS NULL AND status IN ({UNENDED_SQL})""",
            now,
            batch_id,
        )

    async def begin_finalize(self, batch_id: str, terminal: str, now: int) -> bool:
        completed = terminal == COMPLETED
        return (
            await self._execute(
                "ending a batch",
                f"""UPDATE edge_batches SET finalize_as = $1,
                status = CASE WHEN $2 THEN '{FINALIZING}' ELSE status END,
                finalizing_at = CASE WHEN $2 THEN $3 ELSE finalizing_at END,
                lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL
            WHERE id = $4 AND finalize_as IS NULL AND status IN ({UNENDED_SQL})""",
                terminal,
                completed,
                now,
                batch_id,
            )
            == 1
        )

    async def end_batch(
        self,
        batch_id: str,
        terminal: str,
        now: int,
        output: tuple[FileRecord, bytes] | None,
        error: tuple[FileRecord, bytes] | None,
    ) -> bool:
        """The result files (contents and rows) and the final status in one transaction,
        only while the batch is finalizing: two edges finishing the same finalize end it
        once, and the second's files are never stored."""
        async with self._transaction("ending a batch") as connection:
            status = await connection.execute(
                f"""UPDATE edge_batches SET status = $1, {TIMESTAMP_OF[terminal]} = $2,
                    output_file_id = $3, error_file_id = $4, finalize_as = NULL,
                    lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL
                WHERE id = $5 AND finalize_as IS NOT NULL""",
                terminal,
                now,
                None if output is None else output[0].id,
                None if error is None else error[0].id,
                batch_id,
            )
            if count_of(status) == 0:
                return False
            for file in (output, error):
                if file is not None:
                    await write_content(connection, file[0].id, file[1], self._clock())
                    await connection.execute(INSERT_FILE, *file_row(file[0]))
        return True

    # -- lines ---------------------------------------------------------------

    async def get_line(self, batch_id: str, index: int) -> LineRecord | None:
        rows = await self._fetch(
            "reading a line",
            f"SELECT {LINE_COLUMNS} FROM edge_batch_lines WHERE batch_id = $1 AND line_number = $2",
            batch_id,
            index,
        )
        return line_record(tuple(rows[0])) if rows else None

    async def lines(self, batch_id: str) -> list[LineRecord]:
        rows = await self._fetch(
            "reading lines",
            f"SELECT {LINE_COLUMNS} FROM edge_batch_lines WHERE batch_id = $1 ORDER BY line_number",
            batch_id,
        )
        return [line_record(tuple(row)) for row in rows]

    async def first_pending(self, batch_id: str) -> int | None:
        rows = await self._fetch(
            "reading lines",
            "SELECT MIN(line_number) FROM edge_batch_lines WHERE batch_id = $1 AND state = $2",
            batch_id,
            PENDING,
        )
        return None if rows[0][0] is None else int(rows[0][0])

    async def finish_line(self, batch_id: str, index: int, result: LineResult, now: int) -> bool:
        """Store a line's result, committed before this returns; False when it is finished
        already (by this edge or another) or its batch no longer takes results. The
        batch row is share-locked first: ``begin_finalize`` waits for this to commit."""
        async with self._transaction("storing a line") as connection:
            open_batch = await connection.fetchval(
                f"""SELECT 1 FROM edge_batches WHERE id = $1 AND finalize_as IS NULL
                AND status IN ({UNENDED_SQL}) FOR SHARE""",
                batch_id,
            )
            if open_batch is None:
                return False
            status = await connection.execute(
                f"""UPDATE edge_batch_lines SET state = $1, status_code = $2, response = $3,
                    error = $4, request_id = $5, result_id = $6, finished_at = $7
                WHERE batch_id = $8 AND line_number = $9 AND state = '{PENDING}'""",
                result.state,
                result.status_code,
                result.response,
                result.error,
                result.request_id,
                result.result_id,
                now,
                batch_id,
                index,
            )
            return count_of(status) == 1
