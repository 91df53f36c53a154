"""A file's bytes going in and out of the batch store, a chunk at a time.

``Upload`` counts what arrives and refuses it the moment it passes the size
limit; ``FileContent`` reads a stored file back in chunks. Neither holds more
than the chunk in hand, so a 200 MB file costs the edge a megabyte, not 200.
Reads and writes of the content run in threads (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import BinaryIO, Final

from iop_edge.batch_ports import FileUpload
from iop_edge.domain.batches import FileRecord
from iop_edge.errors import InvalidRequest, StorageQuotaExceeded

CHUNK_BYTES: Final = 1024 * 1024


class Upload:
    """A file being received under ``file_id``; the service commits or discards it."""

    def __init__(
        self,
        file_id: str,
        sink: FileUpload,
        limit: int,
        room: int | None = None,
        quota: int = 0,
    ) -> None:
        """``room``: what the key's quota (``quota`` bytes) has left; None: no quota."""
        self.file_id = file_id
        self.size = 0
        self._sink = sink
        self._limit = limit
        self._room = room
        self._quota = quota

    async def write(self, chunk: bytes) -> None:
        """Store the next chunk; ``InvalidRequest`` (400) as soon as the total passes the
        limit, ``StorageQuotaExceeded`` (400) as soon as it passes the key's room."""
        self.size += len(chunk)
        if self.size > self._limit:
            raise InvalidRequest(
                f"The file is larger than the limit of {self._limit} bytes.", param="file"
            )
        if self._room is not None and self.size > self._room:
            raise quota_exceeded(self._quota - self._room, self._quota)
        await self._sink.write(chunk)

    async def commit(self, record: FileRecord) -> None:
        await self._sink.commit(record)

    async def discard(self) -> None:
        await self._sink.discard()


def quota_exceeded(used: int, quota: int) -> StorageQuotaExceeded:
    return StorageQuotaExceeded(
        f"This API key's files take {used} bytes of its {quota}-byte storage quota;"
        " this upload does not fit. Delete files to make room.",
        param="file",
    )


class FileContent:
    """A stored file open for reading: its record and its bytes, chunk by chunk.

    Close it (``aclose``) when done; ``chunks`` closes it at its end.
    """

    def __init__(self, record: FileRecord, handle: BinaryIO) -> None:
        self.record = record
        self._handle = handle

    async def chunks(self, size: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(self._handle.read, size):
                yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._handle.closed:
            await asyncio.to_thread(self._handle.close)


def physical_lines(handle: BinaryIO) -> Iterator[bytes]:
    """Every line of ``handle`` from its start (blocking: for a thread); one line in memory."""
    handle.seek(0)
    yield from handle
