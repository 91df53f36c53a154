"""The port of batch storage (``adapters/batch_store.py`` implements it).

Kept apart from ``ports.py`` only because it is large; ``BatchService`` depends
on this, never on SQLite. Every method is one atomic step: the service's
invariants (a line is finished once, a finalizing batch takes no result)
are enforced by the store, not by the order of the service's calls. Several
edges may share one store (``adapters/pg_batch_store.py``), so a step that
acts on a lease or a batch's end is conditional on the state it was decided
from, and says whether it took effect: the edge's own lock orders its own
calls only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import BinaryIO, Protocol

from iop_edge.domain.batches import BatchRecord, FileRecord, InputLine, LineRecord, LineResult


class FileUpload(Protocol):
    """A file's content as it arrives, written to storage chunk by chunk (never held
    whole); nothing of it exists for readers until ``commit``."""

    async def write(self, chunk: bytes) -> None: ...

    async def commit(self, record: FileRecord) -> None:
        """Make the content durable and store ``record``: the file exists from here."""
        ...

    async def discard(self) -> None:
        """Drop what was written; a no-op after ``commit``, safe to call twice."""
        ...


class BatchStore(Protocol):
    async def begin_upload(self, file_id: str) -> FileUpload: ...

    async def get_file(self, file_id: str) -> FileRecord | None:
        """The file, unless it does not exist or has expired."""
        ...

    async def owned_bytes(self, owner: str | None) -> int:
        """What ``owner``'s files take (counted against its quota)."""
        ...

    async def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, newest: bool
    ) -> list[FileRecord]:
        """``owner``'s files (every owner's when ``None``), newest first or oldest first;
        ``after`` is the last id of the previous page."""
        ...

    async def open_content(self, file_id: str) -> BinaryIO | None:
        """The file's content, open for reading; the caller closes it. Blocking: read
        it off the event loop (``asyncio.to_thread``). It stays readable to the end
        if the file is deleted meanwhile."""
        ...

    async def delete_file(self, file_id: str) -> bool: ...

    async def insert_batch(
        self,
        batch: BatchRecord,
        lines: Iterable[InputLine],
        results: Mapping[int, LineResult] | None = None,
    ) -> None:
        """The batch and its lines (pending, or finished with ``results[index]``), or nothing.

        ``lines`` may be lazy (read from a file as it goes): it is consumed off the
        event loop, inside the transaction, and an error it raises rolls it back.
        """
        ...

    async def get_batch(self, batch_id: str) -> BatchRecord | None: ...

    async def list_batches(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> list[BatchRecord]:
        """Newest first; ``after`` is the last id of the previous page; only ``owner``'s
        batches when it is given."""
        ...

    async def batch_by_lease(self, lease_id: str) -> BatchRecord | None:
        """The batch this lease currently holds (a replaced or freed lease finds nothing)."""
        ...

    async def leasable(self, now: float) -> BatchRecord | None:
        """The oldest runnable batch whose lease is free or expired."""
        ...

    async def to_finalize(self, now: float) -> list[BatchRecord]:
        """Batches whose end is due, or whose finalize began and did not finish."""
        ...

    async def owned_unended(self) -> list[tuple[str, str]]:
        """``(batch id, owner key id)`` of every batch a key owns that has not ended and
        is not ending (running, waiting, or cancelling with no finalize begun)."""
        ...

    async def status_counts(self) -> dict[str, int]: ...

    async def set_lease(
        self, batch_id: str, lease_id: str, owner: str, expires_at: float, now: float
    ) -> bool:
        """Hand the batch to ``owner`` under ``lease_id``; False (nothing changed) unless it
        is runnable, not finalizing, and its lease is free or expired at ``now``."""
        ...

    async def extend_lease(self, batch_id: str, lease_id: str, expires_at: float) -> bool:
        """False (nothing changed) when ``lease_id`` no longer holds the batch."""
        ...

    async def free_lease(
        self, batch_id: str, lease_id: str, not_before: float | None = None
    ) -> None:
        """Nobody holds the batch (``not_before``: nobody may lease it before then); nothing
        when ``lease_id`` no longer holds it."""
        ...

    async def free_leases_of(self, owner: str) -> int: ...

    async def mark_cancelling(self, batch_id: str, now: int) -> None:
        """``cancelling``, unless the batch is frozen or ended meanwhile."""
        ...

    async def begin_finalize(self, batch_id: str, terminal: str, now: int) -> bool:
        """Freeze the batch to end as ``terminal`` (no lease, no more line results); False
        (nothing changed) when it is frozen or ended already."""
        ...

    async def end_batch(
        self,
        batch_id: str,
        terminal: str,
        now: int,
        output: tuple[FileRecord, bytes] | None,
        error: tuple[FileRecord, bytes] | None,
    ) -> bool:
        """The result files (their contents made durable first) and the final status;
        False (nothing stored) when the batch is not finalizing (another call ended it)."""
        ...

    async def get_line(self, batch_id: str, index: int) -> LineRecord | None: ...

    async def lines(self, batch_id: str) -> list[LineRecord]: ...

    async def first_pending(self, batch_id: str) -> int | None: ...

    async def finish_line(self, batch_id: str, index: int, result: LineResult, now: int) -> bool:
        """Store a finished line (committed on return); False when it was finished already
        or its batch takes no more results."""
        ...
