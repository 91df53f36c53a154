"""The files half of the PostgreSQL batch store: file rows, their contents, the TTL sweep.

``PostgresBatchStore`` (``pg_batch_store``) extends it with batches, leases and
lines; the two halves share one pool and the helpers here (each call one
statement or one transaction, an outage ``StorageUnavailable``). Contents are
chunk rows streamed both ways (``pg_batch_files``). Lifetime as SQLite's: a
file expires ``file_ttl_s`` after it was made (0: never) and reads as absent
from then; the sweep removes its row, and its content after the read grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO, Final

import asyncpg
from loguru import logger

from iop_edge.adapters.pg_batch_files import (
    Connection,
    PgContentReader,
    PgUpload,
    mark_deleted,
    purge_contents,
)
from iop_edge.domain.batches import FileRecord
from iop_proto.postgres import StorageUnavailable, reachable
from iop_proto.tasks import cancel_and_wait

FILE_SELECT: Final = "SELECT id, filename, purpose, bytes, created_at, owner FROM edge_files"


def count_of(status: str) -> int:
    """The row count of a command's status (``UPDATE 1``, ``DELETE 0``)."""
    return int(status.rsplit(" ", 1)[-1])


class PgFileStore:
    """Files on PostgreSQL, and the pool helpers ``PostgresBatchStore`` builds on."""

    def __init__(
        self, pool: asyncpg.Pool, file_ttl_s: int = 0, clock: Callable[[], float] = time.time
    ) -> None:
        """Use ``open``."""
        self.file_ttl_s = file_ttl_s
        self._pool = pool
        self._clock = clock
        self._sweeper: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        await cancel_and_wait(sweeper)

    @contextlib.asynccontextmanager
    async def _transaction(self, what: str) -> AsyncIterator[Connection]:
        with reachable(what):
            async with self._pool.acquire() as connection, connection.transaction():
                yield connection

    async def _fetch(self, what: str, sql: str, *args: object) -> list[asyncpg.Record]:
        with reachable(what):
            return list(await self._pool.fetch(sql, *args))

    async def _execute(self, what: str, sql: str, *args: object) -> int:
        with reachable(what):
            return count_of(await self._pool.execute(sql, *args))

    # -- files ---------------------------------------------------------------

    async def begin_upload(self, file_id: str) -> PgUpload:
        return await PgUpload.begin(self._pool, file_id, self._clock)

    async def get_file(self, file_id: str) -> FileRecord | None:
        rows = await self._fetch(
            "reading a file",
            f"{FILE_SELECT} WHERE id = $1 AND created_at > $2",
            file_id,
            self._expired_before(),
        )
        return FileRecord(*rows[0]) if rows else None

    async def owned_bytes(self, owner: str | None) -> int:
        """The bytes of ``owner``'s files (expired ones too, until the sweep removes them)."""
        rows = await self._fetch(
            "counting a key's files",
            "SELECT COALESCE(SUM(bytes), 0) FROM edge_files WHERE owner IS NOT DISTINCT FROM $1",
            owner,
        )
        return int(rows[0][0])

    async def sweep_files(self) -> int:
        """Remove expired files' rows; their contents follow after the read grace."""
        if not self.file_ttl_s:
            return 0
        async with self._transaction("sweeping expired files") as connection:
            rows = await connection.fetch(
                "DELETE FROM edge_files WHERE created_at <= $1 RETURNING id",
                self._expired_before(),
            )
            gone = [str(row[0]) for row in rows]
            await mark_deleted(connection, gone, self._clock())
        if gone:
            logger.info("batch store: {} expired files removed", len(gone))
        return len(gone)

    async def purge_contents(self) -> int:
        """Remove contents past their grace (deleted files', dead uploads')."""
        return await purge_contents(self._pool, self._clock())

    def _expired_before(self) -> int:
        return int(self._clock()) - self.file_ttl_s if self.file_ttl_s else -1

    async def _sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_files()
                await self.purge_contents()
            except StorageUnavailable as error:
                logger.warning("batch store: sweep skipped ({}); the next tries again", error)
            except Exception:
                logger.exception("batch store: file sweep failed; the next tries again")

    async def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, newest: bool
    ) -> list[FileRecord]:
        params: list[Any] = [self._expired_before()]
        where = ["created_at > $1"]

        def param(value: object) -> str:
            params.append(value)
            return f"${len(params)}"

        if owner is not None:
            where.append(f"owner = {param(owner)}")
        if purpose is not None:
            where.append(f"purpose = {param(purpose)}")
        if after is not None:  # a cursor of another owner's is no cursor: existence stays hidden
            mine = "" if owner is None else f" AND owner = {param(owner)}"
            where.append(
                f"seq {'<' if newest else '>'} "
                f"(SELECT seq FROM edge_files WHERE id = {param(after)}{mine})"
            )
        order = "DESC" if newest else "ASC"
        sql = f"{FILE_SELECT} WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT {param(limit)}"
        return [FileRecord(*row) for row in await self._fetch("listing files", sql, *params)]

    async def open_content(self, file_id: str) -> BinaryIO | None:
        if await self.get_file(file_id) is None:
            return None
        return await PgContentReader.open(self._pool, file_id)

    async def delete_file(self, file_id: str) -> bool:
        """The row at once; the content after the grace (a download in progress ends)."""
        async with self._transaction("deleting a file") as connection:
            deleted = await connection.fetchval(
                "DELETE FROM edge_files WHERE id = $1 RETURNING id", file_id
            )
            if deleted is not None:
                await mark_deleted(connection, [file_id], self._clock())
        return deleted is not None
