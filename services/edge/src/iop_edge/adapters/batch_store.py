"""Files, batches and per-line results in one SQLite file, through aiosqlite; file
contents beside it (``batch_files.ContentDir``).

Every statement runs on aiosqlite's thread and every content read or write in
``asyncio.to_thread``, so a 200 MB upload or a finalize of 50,000 lines never
holds the event loop, and an upload is written as it arrives, never held whole.
Each call below is one transaction, and the calls of one connection are
serialised by a lock: transactions of concurrent coroutines must not
interleave on a shared connection.

The file itself (mode, WAL, schema version, migrations) is ``batch_schema``'s.
Durability: a line's result is committed (``synchronous = FULL`` under WAL)
before ``finish_line`` returns, so a line that finished is never run again,
even after a power loss; a file's content is fsynced before its row commits,
and every call that writes returns only once its transaction has committed, so
what the API answers (a file uploaded, a batch created or cancelled) is on disk
before the answer leaves. One edge process owns the file and the directory.

Lifetime: a file expires ``file_ttl_s`` after it was made (OpenAI's 30 days by
default; 0: never): from then on it reads as absent (404, left out of lists),
and a sweep every ``sweep_interval_s`` removes its row, then its content. A
batch keeps its own copy of its lines, so an input file that expires does not
stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import aiosqlite
from loguru import logger

from iop_edge.adapters.batch_files import ContentDir, ContentUpload
from iop_edge.adapters.batch_rows import (
    BATCH_SELECT,
    FILE_SELECT,
    INSERT_FILE,
    LEASE_FREE,
    LINE_COLUMNS,
    RUNNABLE_SQL,
    TIMESTAMP_OF,
    UNENDED_SQL,
    batch_record,
    file_row,
    json_text,
    line_record,
    new_line_row,
)
from iop_edge.adapters.batch_schema import BUSY_TIMEOUT_S, connect
from iop_edge.domain.batches import (
    CANCELLING,
    COMPLETED,
    FINALIZING,
    IN_PROGRESS,
    PENDING,
    STATUSES,
    VALIDATING,
    BatchRecord,
    FileRecord,
    InputLine,
    LineRecord,
    LineResult,
)
from iop_proto.sqlite import transaction
from iop_proto.tasks import cancel_and_wait


class SqliteBatchStore:
    """Make it with ``await SqliteBatchStore.open(path)``; the caller must ``aclose()`` it."""

    def __init__(
        self,
        db: aiosqlite.Connection,
        path: Path,
        contents: ContentDir,
        file_ttl_s: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Use ``open``."""
        self.path = path
        self.contents = contents
        self.file_ttl_s = file_ttl_s
        self._clock = clock
        self._db = db
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        file_ttl_s: int = 0,
        sweep_interval_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> SqliteBatchStore:
        """Open (creating or migrating) the store, and remove what a crash left."""
        contents = ContentDir.beside(path)
        await asyncio.to_thread(contents.prepare, path)
        db = await connect(path, busy_timeout_s, contents)
        try:
            known = [str(row[0]) for row in await db.execute_fetchall("SELECT id FROM files")]
            swept = await asyncio.to_thread(contents.sweep, known)
        except BaseException:
            await db.close()
            raise
        if swept:
            logger.warning("batch store {}: removed {} contents a crash left", path, swept)
        logger.info("batch store {}: opened ({} files in {})", path, len(known), contents.path)
        store = cls(db, path, contents, file_ttl_s, clock)
        if file_ttl_s:
            store._sweeper = asyncio.create_task(
                store._sweep_forever(sweep_interval_s), name="edge-file-sweep"
            )
        return store

    async def aclose(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        await cancel_and_wait(sweeper)
        async with self._lock:
            await self._db.close()

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock, transaction(self._db):
            yield self._db

    async def _fetch(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        async with self._lock:
            return list(await self._db.execute_fetchall(sql, params))

    # -- files ---------------------------------------------------------------

    async def begin_upload(self, file_id: str) -> ContentUpload:
        return await ContentUpload.begin(self.contents, file_id, self._insert_file)

    async def get_file(self, file_id: str) -> FileRecord | None:
        rows = await self._fetch(
            f"{FILE_SELECT} WHERE id = ? AND created_at > ?", (file_id, self._expired_before())
        )
        return FileRecord(*rows[0]) if rows else None

    async def owned_bytes(self, owner: str | None) -> int:
        """The bytes of ``owner``'s files (expired ones too, until the sweep removes them)."""
        rows = await self._fetch(
            "SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner IS ?", (owner,)
        )
        return int(rows[0][0])

    async def sweep_files(self) -> int:
        """Remove expired files: the rows (one transaction), then their contents."""
        if not self.file_ttl_s:
            return 0
        async with self._write() as db:
            cursor = await db.execute(
                "DELETE FROM files WHERE created_at <= ? RETURNING id", (self._expired_before(),)
            )
            gone = [str(row[0]) for row in await cursor.fetchall()]
        for file_id in gone:
            await asyncio.to_thread(self.contents.remove, file_id)
        if gone:
            logger.info("batch store {}: {} expired files removed", self.path, len(gone))
        return len(gone)

    def _expired_before(self) -> int:
        """Files made at or before this are expired (none when files never expire)."""
        return int(self._clock()) - self.file_ttl_s if self.file_ttl_s else -1

    async def _sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_files()
            except Exception:
                logger.exception(
                    "batch store {}: file sweep failed; the next tries again", self.path
                )

    async def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, newest: bool
    ) -> list[FileRecord]:
        """Newest (or oldest) first by insertion; ``after`` is the last id of the previous page."""
        where: list[str] = ["created_at > ?"]
        params: list[Any] = [self._expired_before()]
        if owner is not None:
            where.append("owner = ?")
            params.append(owner)
        if purpose is not None:
            where.append("purpose = ?")
            params.append(purpose)
        if after is not None:  # a cursor of another owner's is no cursor: existence stays hidden
            mine = "" if owner is None else " AND owner = ?"
            where.append(
                f"rowid {'<' if newest else '>'} (SELECT rowid FROM files WHERE id = ?{mine})"
            )
            params.extend([after] if owner is None else [after, owner])
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        order = "DESC" if newest else "ASC"
        rows = await self._fetch(
            f"{FILE_SELECT} {clause} ORDER BY rowid {order} LIMIT ?", (*params, limit)
        )
        return [FileRecord(*row) for row in rows]

    async def open_content(self, file_id: str) -> BinaryIO | None:
        if await self.get_file(file_id) is None:
            return None
        return await asyncio.to_thread(self.contents.open, file_id)

    async def delete_file(self, file_id: str) -> bool:
        """The row first, then the content (a crash between leaves content for the sweep)."""
        async with self._write() as db:
            cursor = await db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            deleted = cursor.rowcount > 0
        if deleted:
            await asyncio.to_thread(self.contents.remove, file_id)
        return deleted

    async def _insert_file(self, record: FileRecord) -> None:
        async with self._write() as db:
            await db.execute(INSERT_FILE, file_row(record))

    # -- batches -------------------------------------------------------------

    async def insert_batch(
        self,
        batch: BatchRecord,
        lines: Iterable[InputLine],
        results: Mapping[int, LineResult] | None = None,
    ) -> None:
        """The batch and all its lines (pending, or finished with ``results[index]``);
        ``lines`` is consumed on aiosqlite's thread."""
        done = results or {}
        async with self._write() as db:
            await db.execute(
                """INSERT INTO batches (id, input_file_id, endpoint, completion_window,
                    metadata, status, created_at, failed_at, expires_at, errors, total_lines,
                    owner)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (
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
                ),
            )
            await db.executemany(
                f"INSERT INTO batch_lines ({LINE_COLUMNS}, finished_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (new_line_row(batch, line, done.get(line.index)) for line in lines),
            )

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        rows = await self._fetch(f"{BATCH_SELECT} WHERE b.id = ?", (batch_id,))
        return batch_record(rows[0]) if rows else None

    async def list_batches(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> list[BatchRecord]:
        """Newest first; ``after`` is the last id of the previous page; only ``owner``'s
        batches when it is given."""
        where, params = [], []
        if owner is not None:
            where.append("b.owner = ?")
            params.append(owner)
        if after is not None:  # a cursor of another owner's is no cursor: existence stays hidden
            mine = "" if owner is None else " AND owner = ?"
            where.append(f"b.seq < (SELECT seq FROM batches WHERE id = ?{mine})")
            params.extend([after] if owner is None else [after, owner])
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._fetch(
            f"{BATCH_SELECT} {clause} ORDER BY b.seq DESC LIMIT ?", (*params, limit)
        )
        return [batch_record(row) for row in rows]

    async def batch_by_lease(self, lease_id: str) -> BatchRecord | None:
        rows = await self._fetch(f"{BATCH_SELECT} WHERE b.lease_id = ?", (lease_id,))
        return batch_record(rows[0]) if rows else None

    async def leasable(self, now: float) -> BatchRecord | None:
        """The oldest runnable batch nobody holds (a lease past its expiry holds nothing)."""
        rows = await self._fetch(
            f"""{BATCH_SELECT} WHERE b.status IN ({RUNNABLE_SQL}) AND b.finalize_as IS NULL
            AND {LEASE_FREE} ORDER BY b.seq LIMIT 1""",
            {"now": now},
        )
        return batch_record(rows[0]) if rows else None

    async def to_finalize(self, now: float) -> list[BatchRecord]:
        """Batches whose end is due: cancelling or past their window with no live lease,
        and those left half-finalized (by a crash, or by a finalize in progress)."""
        rows = await self._fetch(
            f"""{BATCH_SELECT} WHERE b.finalize_as IS NOT NULL
            OR (b.status = '{CANCELLING}' AND {LEASE_FREE})
            OR (b.status IN ({RUNNABLE_SQL}) AND b.expires_at <= :now AND {LEASE_FREE})
            ORDER BY b.seq""",
            {"now": now},
        )
        return [batch_record(row) for row in rows]

    async def owned_unended(self) -> list[tuple[str, str]]:
        rows = await self._fetch(
            f"""SELECT id, owner FROM batches WHERE owner IS NOT NULL AND finalize_as IS NULL
            AND status IN ({RUNNABLE_SQL}, '{CANCELLING}') ORDER BY seq"""
        )
        return [(str(batch_id), str(owner)) for batch_id, owner in rows]

    async def status_counts(self) -> dict[str, int]:
        rows = await self._fetch("SELECT status, COUNT(*) FROM batches GROUP BY status")
        counts = dict.fromkeys(STATUSES, 0)
        counts.update({str(status): int(count) for status, count in rows})
        return counts

    async def set_lease(
        self, batch_id: str, lease_id: str, owner: str, expires_at: float, now: float
    ) -> bool:
        """Hand the batch to a worker, if it is still free at ``now``; a validating batch
        starts here."""
        async with self._write() as db:
            cursor = await db.execute(
                f"""UPDATE batches SET lease_id = ?, lease_owner = ?, lease_expires_at = ?,
                    status = '{IN_PROGRESS}', in_progress_at = COALESCE(in_progress_at, ?)
                WHERE id = ? AND status IN ({RUNNABLE_SQL}) AND finalize_as IS NULL
                AND (lease_expires_at IS NULL OR lease_expires_at <= ?)""",
                (lease_id, owner, expires_at, int(now), batch_id, now),
            )
            return cursor.rowcount > 0

    async def extend_lease(self, batch_id: str, lease_id: str, expires_at: float) -> bool:
        async with self._write() as db:
            cursor = await db.execute(
                "UPDATE batches SET lease_expires_at = ? WHERE id = ? AND lease_id = ?",
                (expires_at, batch_id, lease_id),
            )
            return cursor.rowcount > 0

    async def free_lease(
        self, batch_id: str, lease_id: str, not_before: float | None = None
    ) -> None:
        """Nobody holds the batch; ``not_before`` keeps it from being leased until then."""
        async with self._write() as db:
            await db.execute(
                """UPDATE batches SET lease_id = NULL, lease_owner = NULL, lease_expires_at = ?
                WHERE id = ? AND lease_id = ?""",
                (not_before, batch_id, lease_id),
            )

    async def free_leases_of(self, owner: str) -> int:
        """Free every lease a worker held: it came back and holds none of them now."""
        async with self._write() as db:
            cursor = await db.execute(
                """UPDATE batches SET lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL
                WHERE lease_owner = ?""",
                (owner,),
            )
            return cursor.rowcount

    async def mark_cancelling(self, batch_id: str, now: int) -> None:
        async with self._write() as db:
            await db.execute(
                f"""UPDATE batches SET status = '{CANCELLING}', cancelling_at = ?
                WHERE id = ? AND finalize_as IS NULL AND status IN ({UNENDED_SQL})""",
                (now, batch_id),
            )

    async def begin_finalize(self, batch_id: str, terminal: str, now: int) -> bool:
        """From here the batch takes no lease and no line result; a normal end shows
        ``finalizing`` (a cancel or an expiry keeps its status until the end)."""
        status = "status = ?, finalizing_at = ?," if terminal == COMPLETED else ""
        params: tuple[Any, ...] = (FINALIZING, now) if terminal == COMPLETED else ()
        async with self._write() as db:
            cursor = await db.execute(
                f"""UPDATE batches SET {status} finalize_as = ?,
                    lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL
                WHERE id = ? AND finalize_as IS NULL AND status IN ({UNENDED_SQL})""",
                (*params, terminal, batch_id),
            )
            return cursor.rowcount > 0

    async def end_batch(
        self,
        batch_id: str,
        terminal: str,
        now: int,
        output: tuple[FileRecord, bytes] | None,
        error: tuple[FileRecord, bytes] | None,
    ) -> bool:
        """The result files and the final status, in one transaction (so a crash leaves
        the batch to be finalized again, never with half its files), only while the
        batch is finalizing. Their contents are written (durably) first; if the
        transaction fails or ends nothing they are removed, and a crash leaves them to
        the next open's sweep."""
        files = [file for file in (output, error) if file is not None]
        for record, content in files:
            await asyncio.to_thread(self.contents.write, record.id, content)
        ended = False
        try:
            ended = await self._end_batch(batch_id, terminal, now, output, error)
        finally:
            if not ended:
                for record, _ in files:
                    await asyncio.to_thread(self.contents.remove, record.id)
        return ended

    async def _end_batch(
        self,
        batch_id: str,
        terminal: str,
        now: int,
        output: tuple[FileRecord, bytes] | None,
        error: tuple[FileRecord, bytes] | None,
    ) -> bool:
        async with self._write() as db:
            cursor = await db.execute(
                f"""UPDATE batches SET status = ?, {TIMESTAMP_OF[terminal]} = ?,
                    output_file_id = ?, error_file_id = ?, finalize_as = NULL,
                    lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL
                WHERE id = ? AND finalize_as IS NOT NULL""",
                (
                    terminal,
                    now,
                    None if output is None else output[0].id,
                    None if error is None else error[0].id,
                    batch_id,
                ),
            )
            if cursor.rowcount == 0:
                return False  # ended already (by another edge's finalize): store nothing
            for file in (output, error):
                if file is not None:
                    await db.execute(INSERT_FILE, file_row(file[0]))
            return True

    # -- lines ---------------------------------------------------------------

    async def get_line(self, batch_id: str, index: int) -> LineRecord | None:
        rows = await self._fetch(
            f"SELECT {LINE_COLUMNS} FROM batch_lines WHERE batch_id = ? AND line_number = ?",
            (batch_id, index),
        )
        return line_record(rows[0]) if rows else None

    async def lines(self, batch_id: str) -> list[LineRecord]:
        rows = await self._fetch(
            f"SELECT {LINE_COLUMNS} FROM batch_lines WHERE batch_id = ? ORDER BY line_number",
            (batch_id,),
        )
        return [line_record(row) for row in rows]

    async def first_pending(self, batch_id: str) -> int | None:
        rows = await self._fetch(
            "SELECT MIN(line_number) FROM batch_lines WHERE batch_id = ? AND state = ?",
            (batch_id, PENDING),
        )
        return None if rows[0][0] is None else int(rows[0][0])

    async def finish_line(self, batch_id: str, index: int, result: LineResult, now: int) -> bool:
        """Store a line's result, committed before this returns; False (nothing written)
        when the line is already finished or the batch no longer takes results."""
        async with self._write() as db:
            cursor = await db.execute(
                f"""UPDATE batch_lines SET state = ?, status_code = ?, response = ?, error = ?,
                    request_id = ?, result_id = ?, finished_at = ?
                WHERE batch_id = ? AND line_number = ? AND state = '{PENDING}'
                AND EXISTS (SELECT 1 FROM batches WHERE id = ? AND finalize_as IS NULL
                    AND status IN ('{VALIDATING}', '{IN_PROGRESS}', '{CANCELLING}'))""",
                (
                    result.state,
                    result.status_code,
                    result.response,
                    result.error,
                    result.request_id,
                    result.result_id,
                    now,
                    batch_id,
                    index,
                    batch_id,
                ),
            )
            return cursor.rowcount > 0
