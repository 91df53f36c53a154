"""File contents in PostgreSQL: ``edge_file_chunks`` rows of up to a MiB, streamed both ways.

Writing (``PgUpload``): what arrives is gathered into chunks of ``CHUNK_BYTES``
and each chunk is inserted as it fills, in a short transaction of its own, so
an upload holds one chunk in memory and no connection between chunks (a slow
client never pins one of the pool's few connections). The content's row in
``edge_file_contents`` says 'uploading' until ``commit``, which in one
transaction marks it 'stored' and inserts the ``edge_files`` row: readers find
a file only through that row, so nothing of an upload exists for them before
the commit. An upload cut short by a crash leaves an 'uploading' content that
``purge_contents`` removes once it has been idle for ``UPLOAD_IDLE_S``.

Reading (``PgContentReader``): the port's ``open_content`` result is a blocking
``BinaryIO`` read off the event loop (``asyncio.to_thread``), while asyncpg's
pool belongs to the loop and is not thread-safe. The reader therefore never
touches a connection itself: for each chunk it hands a coroutine to the loop
(``asyncio.run_coroutine_threadsafe``) and waits on its future; the coroutine
acquires a pooled connection for one ``SELECT`` and gives it back. One chunk is
in memory at a time, no connection is held between reads, and read on the
loop's own thread it refuses (waiting there would deadlock the loop). A
coroutine that holds a connection and waits for a reader (storing a batch's
lines from its input file) lends it that connection (``LENT``).

Deleting: a file's row goes at once; its content is marked 'deleted' and
removed by ``purge_contents`` after ``DELETED_GRACE_S``, so a download in
progress reads to its end (the port's promise, as an open file does on disk).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Final, TypeAlias

import asyncpg

from iop_edge.adapters.batch_rows import file_row
from iop_edge.domain.batches import FileRecord
from iop_proto.postgres import StorageUnavailable, reachable

if TYPE_CHECKING:  # generic in asyncpg's stubs only
    from asyncpg.pool import PoolConnectionProxy

    Connection: TypeAlias = PoolConnectionProxy[asyncpg.Record]
    """A connection borrowed from the pool (what ``pool.acquire()`` yields)."""
else:
    from asyncpg.pool import PoolConnectionProxy as Connection

CHUNK_BYTES: Final = 1024 * 1024
UPLOAD_IDLE_S: Final = 3600.0
"""An upload that wrote nothing for this long is dead (its edge crashed); its chunks go."""
DELETED_GRACE_S: Final = 3600.0
"""How long a deleted (or expired) file's content stays readable for downloads in progress."""
READ_TIMEOUT_S: Final = 120.0
"""The most a reader thread waits for one chunk (a pool wait plus one ``SELECT``)."""

LENT: Final[ContextVar[Connection | None]] = ContextVar("iop_edge_pg_lent", default=None)
"""A connection a coroutine holds and lends to the readers it drives from a thread while
it waits for them (``PostgresBatchStore.insert_batch``: its transaction reads the input
file's chunks itself). Without it that reading needs a second connection while the
first is held: with every pooled connection held by such a transaction, none is left
for their readers and they all wait out ``READ_TIMEOUT_S``."""

INSERT_FILE: Final = """INSERT INTO edge_files (id, filename, purpose, bytes, created_at, owner)
    VALUES ($1, $2, $3, $4, $5, $6)"""
_NEW_CONTENT: Final = """INSERT INTO edge_file_contents (file_id, state, touched_at)
    VALUES ($1, $2, $3)"""
_CHUNK: Final = "INSERT INTO edge_file_chunks (file_id, seq, data) VALUES ($1, $2, $3)"


async def write_content(connection: Connection, file_id: str, content: bytes, now: float) -> None:
    """Store a whole content as 'stored' chunks, inside the caller's transaction (a
    batch's result files, committed with the batch's end)."""
    await connection.execute(_NEW_CONTENT, file_id, "stored", now)
    view = memoryview(content)
    await connection.executemany(
        _CHUNK,
        (
            (file_id, seq, bytes(view[start : start + CHUNK_BYTES]))
            for seq, start in enumerate(range(0, len(content), CHUNK_BYTES))
        ),
    )


async def mark_deleted(connection: Connection, file_ids: list[str], now: float) -> None:
    """The contents of files whose rows were deleted: readable for the grace, then purged."""
    await connection.execute(
        """UPDATE edge_file_contents SET state = 'deleted', touched_at = $2
        WHERE file_id = ANY($1::text[])""",
        file_ids,
        now,
    )


async def purge_contents(pool: asyncpg.Pool, now: float) -> int:
    """Remove contents deleted longer than the grace ago, and uploads idle past their
    limit (cut short by a crash); their chunks go with them (``ON DELETE CASCADE``)."""
    with reachable("purging file contents"):
        rows = await pool.fetch(
            """DELETE FROM edge_file_contents
            WHERE (state = 'deleted' AND touched_at <= $1)
               OR (state = 'uploading' AND touched_at <= $2)
            RETURNING file_id""",
            now - DELETED_GRACE_S,
            now - UPLOAD_IDLE_S,
        )
    return len(rows)


class PgUpload:
    """The store's ``FileUpload`` on PostgreSQL: chunks inserted as they fill."""

    def __init__(self, pool: asyncpg.Pool, file_id: str, clock: Callable[[], float]) -> None:
        """Use ``begin``."""
        self._pool = pool
        self._file_id = file_id
        self._clock = clock
        self._buffer = bytearray()
        self._seq = 0
        self._open = True

    @classmethod
    async def begin(cls, pool: asyncpg.Pool, file_id: str, clock: Callable[[], float]) -> PgUpload:
        with reachable("starting an upload"):
            await pool.execute(_NEW_CONTENT, file_id, "uploading", clock())
        return cls(pool, file_id, clock)

    async def write(self, chunk: bytes) -> None:
        if not self._open:
            raise ValueError(f"upload {self._file_id} is already committed or discarded")
        self._buffer += chunk
        while len(self._buffer) >= CHUNK_BYTES:
            await self._flush(bytes(self._buffer[:CHUNK_BYTES]))
            del self._buffer[:CHUNK_BYTES]

    async def _flush(self, data: bytes) -> None:
        with reachable("storing an upload's chunk"):
            async with self._pool.acquire() as connection, connection.transaction():
                await connection.execute(_CHUNK, self._file_id, self._seq, data)
                # Touched: an upload that goes on is never taken for one a crash left.
                await connection.execute(
                    "UPDATE edge_file_contents SET touched_at = GREATEST(touched_at, $2) "
                    "WHERE file_id = $1",
                    self._file_id,
                    self._clock(),
                )
        self._seq += 1

    async def commit(self, record: FileRecord) -> None:
        if not self._open or record.id != self._file_id:
            raise ValueError(f"upload {self._file_id} cannot be committed as {record.id}")
        self._open = False
        try:
            if self._buffer:
                await self._flush(bytes(self._buffer))
                self._buffer.clear()
            with reachable("storing a file"):
                async with self._pool.acquire() as connection, connection.transaction():
                    stored = await connection.execute(
                        "UPDATE edge_file_contents SET state = 'stored' "
                        "WHERE file_id = $1 AND state = 'uploading'",
                        self._file_id,
                    )
                    if stored != "UPDATE 1":
                        raise RuntimeError(f"upload {self._file_id}: its content is gone")
                    await connection.execute(INSERT_FILE, *file_row(record))
        except BaseException:
            await self._drop()
            raise

    async def discard(self) -> None:
        if self._open:
            self._open = False
            self._buffer.clear()
            await self._drop()

    async def _drop(self) -> None:
        """Remove the uncommitted content; an outage leaves it to ``purge_contents``."""
        with contextlib.suppress(StorageUnavailable), reachable("discarding an upload"):
            await self._pool.execute(
                "DELETE FROM edge_file_contents WHERE file_id = $1 AND state = 'uploading'",
                self._file_id,
            )


class PgContentReader(io.RawIOBase):
    """A stored content, read chunk by chunk from a thread (see the module's docstring).

    ``sizes`` are the chunks' lengths, read when the file was opened: they give
    ``seek`` and ``tell`` (``physical_lines`` rewinds to read a file twice).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        loop: asyncio.AbstractEventLoop,
        file_id: str,
        sizes: list[int],
    ) -> None:
        super().__init__()
        self._pool = pool
        self._loop = loop
        self._file_id = file_id
        self._starts = [0]
        for size in sizes:
            self._starts.append(self._starts[-1] + size)
        self._position = 0
        self._chunk_seq = -1
        self._chunk = b""

    @classmethod
    async def open(cls, pool: asyncpg.Pool, file_id: str) -> io.BufferedReader:
        with reachable("opening a file"):
            rows = await pool.fetch(
                "SELECT octet_length(data) FROM edge_file_chunks WHERE file_id = $1 ORDER BY seq",
                file_id,
            )
        raw = cls(pool, asyncio.get_running_loop(), file_id, [int(row[0]) for row in rows])
        return io.BufferedReader(raw, buffer_size=64 * 1024)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._starts[-1]}
        self._position = max(0, base[whence] + offset)
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._position >= self._starts[-1]:
            return 0
        seq = self._seq_at(self._position)
        if seq != self._chunk_seq:
            self._chunk = self._fetch(seq)
            self._chunk_seq = seq
        offset = self._position - self._starts[seq]
        data = self._chunk[offset : offset + len(buffer)]
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def _seq_at(self, position: int) -> int:
        return bisect.bisect_right(self._starts, position) - 1

    def _fetch(self, seq: int) -> bytes:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None  # a thread: the one place a reader may wait on the loop
        if running is self._loop:
            raise RuntimeError("read a stored file off the event loop (asyncio.to_thread)")
        # The caller's context (``asyncio.to_thread`` runs us in a copy of it) may lend
        # the connection its coroutine holds and waits with.
        coroutine = self._select(seq, LENT.get())
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(READ_TIMEOUT_S)

    async def _select(self, seq: int, lent: Connection | None) -> bytes:
        sql = "SELECT data FROM edge_file_chunks WHERE file_id = $1 AND seq = $2"
        with reachable("reading a file"):
            if lent is not None:
                data = await lent.fetchval(sql, self._file_id, seq)
            else:
                data = await self._pool.fetchval(sql, self._file_id, seq)
        if data is None:
            raise OSError(f"file {self._file_id}: chunk {seq} is gone")
        return bytes(data)

    def close(self) -> None:
        self._chunk = b""
        super().close()
