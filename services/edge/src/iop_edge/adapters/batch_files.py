"""The content of the batch store's files: one plain file each, in a directory beside the database.

Why not SQLite BLOBs: a BLOB is written whole in one statement (the whole
upload in memory), or with incremental blob I/O inside one write transaction
that holds the store's only writer for the whole copy (a finished line would
wait behind a 200 MB upload, past the busy timeout), and every byte goes
through the WAL and a checkpoint as well. A plain file is written once, chunk
by chunk as it arrives, and read back the same way; SQLite keeps only the
metadata (``files`` rows).

The order of the steps keeps the two consistent through a crash: content is
made durable (fsync, rename, fsync of the directory) before its row commits,
and a row is deleted before its content. What a crash can leave is content
without a row, and ``sweep`` removes that when the store opens.

Every method of ``ContentDir`` blocks: the store calls them through
``asyncio.to_thread``, and so does ``ContentUpload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from io import BufferedReader, BufferedWriter
from pathlib import Path
from typing import Final

from iop_edge.domain.batches import FileRecord
from iop_proto.sqlite import prepare_file

_ID: Final = re.compile(r"file-[0-9a-f]{32}")
"""Every stored id is ours (``new_id("file-")``): nothing a client sends names a path."""
_PARTIAL: Final = ".part"


class ContentDir:
    """The directory of file contents (owner-only, like the database)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def beside(cls, database: Path) -> ContentDir:
        """``batches.db`` keeps its contents in ``batches.files/``."""
        return cls(database.with_suffix(".files"))

    def prepare(self, database: Path) -> None:
        """Create the directory (and the database's own, owner-only) if missing."""
        prepare_file(database)
        self.path.mkdir(mode=0o700, exist_ok=True)
        self.path.chmod(0o700)

    def content_path(self, file_id: str) -> Path:
        if not _ID.fullmatch(file_id):
            raise ValueError(f"not a stored file id: {file_id!r}")
        return self.path / file_id

    def partial_path(self, file_id: str) -> Path:
        return self.content_path(file_id).with_suffix(_PARTIAL)

    def create_partial(self, file_id: str) -> BufferedWriter:
        """A new, empty, owner-only file that becomes ``file_id``'s content at ``publish``."""
        fd = os.open(self.partial_path(file_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        return open(fd, "wb")

    def publish(self, file_id: str, handle: BufferedWriter) -> None:
        """Make a partial file durable and give it its final name (closes ``handle``)."""
        try:
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            handle.close()
        os.replace(self.partial_path(file_id), self.content_path(file_id))
        self._sync_directory()

    def write(self, file_id: str, content: bytes) -> None:
        """Store a whole content durably (a batch's output or error file, a migrated BLOB)."""
        self.discard(file_id)  # left by an attempt a crash cut short
        handle = self.create_partial(file_id)
        try:
            handle.write(content)
        except BaseException:
            handle.close()
            self.discard(file_id)
            raise
        self.publish(file_id, handle)

    def discard(self, file_id: str) -> None:
        """Remove a partial file (an upload refused or cut short); nothing if there is none."""
        with contextlib.suppress(FileNotFoundError):
            self.partial_path(file_id).unlink()

    def remove(self, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.content_path(file_id).unlink()

    def open(self, file_id: str) -> BufferedReader | None:
        """The content, open for reading (the caller closes it); ``None`` when absent.

        An open file stays readable after ``remove`` (POSIX), so a download in
        progress finishes even if the file is deleted meanwhile.
        """
        try:
            return self.content_path(file_id).open("rb")
        except FileNotFoundError:
            return None

    def sweep(self, known: Iterable[str]) -> int:
        """Remove every content no row names, and every partial file: what a crash left.

        Only while nothing is being uploaded (the store calls it when it opens).
        """
        keep = set(known)
        removed = 0
        for entry in self.path.iterdir():
            if entry.name in keep and entry.is_file():
                continue
            if entry.is_file() and (_ID.fullmatch(entry.stem) or _ID.fullmatch(entry.name)):
                entry.unlink()
                removed += 1
        return removed

    def _sync_directory(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ContentUpload:
    """The store's ``FileUpload``: chunks go to a partial file as they come; ``commit``
    publishes it (fsync, rename), then ``insert`` commits its row."""

    def __init__(
        self,
        contents: ContentDir,
        file_id: str,
        handle: BufferedWriter,
        insert: Callable[[FileRecord], Awaitable[None]],
    ) -> None:
        """Use ``begin``."""
        self._contents = contents
        self._file_id = file_id
        self._handle: BufferedWriter | None = handle
        self._insert = insert

    @classmethod
    async def begin(
        cls,
        contents: ContentDir,
        file_id: str,
        insert: Callable[[FileRecord], Awaitable[None]],
    ) -> ContentUpload:
        handle = await asyncio.to_thread(contents.create_partial, file_id)
        return cls(contents, file_id, handle, insert)

    async def write(self, chunk: bytes) -> None:
        if self._handle is None:
            raise ValueError(f"upload {self._file_id} is already committed or discarded")
        await asyncio.to_thread(self._handle.write, chunk)

    async def commit(self, record: FileRecord) -> None:
        handle, self._handle = self._handle, None
        if handle is None or record.id != self._file_id:
            raise ValueError(f"upload {self._file_id} cannot be committed as {record.id}")
        try:
            await asyncio.to_thread(self._contents.publish, record.id, handle)
            await self._insert(record)
        except BaseException:
            await asyncio.to_thread(self._contents.discard, record.id)
            await asyncio.to_thread(self._contents.remove, record.id)
            raise

    async def discard(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            await asyncio.to_thread(handle.close)
            await asyncio.to_thread(self._contents.discard, self._file_id)
