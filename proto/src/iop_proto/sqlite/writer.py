"""Records written to SQLite by one background task in batches, never in the caller's way.

The request path must never wait for a disk: ``put`` only files the record in
an in-memory map keyed by the record's id and wakes the writer, which commits
whatever is pending in one transaction per batch. Keying by id means a record
that is replaced before it was written (a run's end after its start) costs one
row write, not two. While the database refuses writes, the writer retries with
a growing pause, and memory stays bounded by dropping records (counted, logged).

Durability is the caller's choice, per record. ``put`` trades it knowingly:
records still in memory when the process is killed are lost (the edge's run
log and the node's run history, this writer with their own table, row mapping
and queries). ``persist`` waits until its record's batch has committed, so
whatever a caller acknowledges after it is on disk; it skips the coalescing
pause, and records that arrive while a batch commits share the next commit
(group commit: one fsync for all of them, not one each).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import aiosqlite
from loguru import logger

from iop_proto.sqlite.files import transaction
from iop_proto.tasks import cancel_and_wait

R = TypeVar("R")

MAX_RETRY_DELAY_S = 30.0
"""The longest pause between two attempts while the database keeps refusing writes."""


@dataclass(frozen=True, slots=True)
class WriterTuning:
    """How the writer batches; checked when made, so before any file is opened."""

    flush_interval_s: float
    """How long the writer lets records gather after the first one arrives, so a
    burst shares a transaction (a waiting ``flush`` cuts it short)."""
    max_batch: int
    max_pending: int
    """Records kept in memory at the most while the database refuses writes."""
    retry_delay_s: float
    """The first pause after a failed write; it doubles up to ``MAX_RETRY_DELAY_S``."""

    def __post_init__(self) -> None:
        if self.flush_interval_s < 0 or self.retry_delay_s < 0:
            raise ValueError("flush_interval_s and retry_delay_s must not be negative")
        if self.max_batch < 1 or self.max_pending < 1:
            raise ValueError("max_batch and max_pending must be at least 1")


class QueuedWriter(Generic[R]):
    """The queue, the writer task and its retries; subclasses say what a record is
    and where a batch is committed (``_commit``: SQLite in ``BatchedWriter``, a
    PostgreSQL pool in the edge's shared run log).

    A subclass sets ``what`` (the file's name in logs), ``noun`` (a record's),
    ``statement`` (run with ``executemany`` for each batch), ``error`` and
    ``closed_error`` (raised for a stopped writer and after ``aclose``), and
    implements ``_key`` and ``_row``; ``_supersedes``, ``_shed_first`` and
    ``_shed_note`` have defaults (the newer record wins, the oldest are dropped).

    ``writes`` counts committed batches, ``failed_writes`` failed attempts (each
    logged and retried) and ``dropped`` records given up to bound memory while
    the database refused writes; plain counters for tests and metrics.
    """

    what: ClassVar[str] = "database"
    noun: ClassVar[str] = "record"
    statement: ClassVar[str]
    error: ClassVar[type[Exception]] = RuntimeError
    closed_error: ClassVar[type[Exception]] = RuntimeError

    def __init__(self, path: Path | str, tuning: WriterTuning) -> None:
        """Wire the state; ``start`` starts the writer (a subclass may read first).

        ``path`` names where records go, in logs and errors.
        """
        self.path = path
        self.writes = 0
        self.failed_writes = 0
        self.dropped = 0
        self._flush_interval_s = tuning.flush_interval_s
        self._max_batch = tuning.max_batch
        self._max_pending = tuning.max_pending
        self._retry_delay_s = tuning.retry_delay_s
        # Ordered oldest first by sequence number: a re-put moves to the end, so the
        # front is always the oldest unwritten change and batches are taken from there.
        self._pending: dict[str, tuple[int, R]] = {}
        self._in_flight: dict[str, tuple[int, R]] = {}  # the batch being committed
        self._seq = 0
        # persist()'s callers, by the sequence number of the record they wait for.
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._wake = asyncio.Event()  # something is pending
        self._urgent = asyncio.Event()  # a flush waits: skip the coalescing pause
        self._progress = asyncio.Event()  # set (and replaced) when flushes should look again
        self._drains = 0  # flushes waiting on ``_progress`` now
        self._write_lock = asyncio.Lock()  # one transaction at a time on the shared connection
        self._writer: asyncio.Task[None] | None = None
        self._closed = False

    # -- what a subclass says ------------------------------------------------------

    async def _commit(self, rows: list[tuple[object, ...]]) -> None:
        """Run ``statement`` for each of ``rows`` in one transaction; raise if it failed."""
        raise NotImplementedError

    async def _close_backend(self) -> None:
        """Release what ``_commit`` writes to, once the writer has stopped."""

    def _key(self, record: R) -> str:
        """The record's id: a record put again under the same id replaces the unwritten one."""
        raise NotImplementedError

    def _row(self, record: R) -> tuple[object, ...]:
        """The parameters of ``statement`` for one record."""
        raise NotImplementedError

    def _supersedes(self, new: R, old: R) -> bool:
        """Whether ``new`` may replace ``old`` (same id) in memory; by default it may."""
        return True

    def _shed_first(self, record: R) -> bool:
        """Records for which this is true are dropped before the others (oldest first)."""
        return False

    def _shed_note(self, victims: list[R]) -> str:
        return f"{len(victims)} unwritten {self.noun}(s) dropped"

    # -- the service's calls -------------------------------------------------------

    def start(self, name: str) -> None:
        """Start the writer task (once, at the end of the subclass's ``open``)."""
        self._writer = asyncio.create_task(self._write_forever(), name=name)
        # A writer that dies of a bug wakes the flushes too: they raise, not hang.
        self._writer.add_done_callback(lambda _: self._writer_ended())

    def check_open(self) -> None:
        if self._closed:
            raise self.closed_error(f"{self.what} {self.path} is closed")

    def put(self, record: R) -> None:
        """Queue ``record``; returns without waiting for the disk (never suspends)."""
        if self._closed:
            raise self.closed_error(f"{self.what} {self.path} is closed")
        key = self._key(record)
        previous = self._pending.pop(key, None)
        if previous is not None and not self._supersedes(record, previous[1]):
            record = previous[1]
        self._seq += 1
        self._pending[key] = (self._seq, record)
        if previous is not None and previous[0] in self._waiters:
            # What waited for the replaced record is written with the one replacing it.
            self._waiters[self._seq] = self._waiters.pop(previous[0])
        if len(self._pending) > self._max_pending:
            self._shed()
        self._wake.set()

    async def persist(self, record: R) -> None:
        """Queue ``record`` and return once the transaction holding it has committed.

        Raises ``error`` when the record was dropped (the database refused writes
        until memory had to be bounded) or the writer stopped first. Cancelling the
        caller does not take the record back: it is written all the same. While
        the database refuses writes this waits for the writer's retries; bound it
        with ``asyncio.timeout`` where that matters.
        """
        self.put(record)
        seq = self._seq
        if self._pending.get(self._key(record), (None,))[0] != seq:
            raise self.error(f"{self.what} {self.path}: {self.noun} dropped before it was written")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(seq, []).append(waiter)
        if self._writer is None or self._writer.done():
            self._fail_waiters(list(self._waiters), "the writer has stopped")
        self._urgent.set()  # an acknowledgement waits: no coalescing pause
        await asyncio.shield(waiter)

    def unwritten(self) -> list[R]:
        """The records not yet on disk, oldest first (the batch being written included).

        Take this before querying the table: a batch committed while the query
        runs is then either in this list or in the rows, never in neither.
        """
        return [record for _, record in (*self._in_flight.values(), *self._pending.values())]

    def latest(self, stored: Iterable[R], unwritten: Iterable[R]) -> list[R]:
        """Rows read from the table merged with ``unwritten``, one record per id."""
        merged: dict[str, R] = {}
        for record in (*stored, *unwritten):  # oldest knowledge first
            key = self._key(record)
            known = merged.get(key)
            if known is None or self._supersedes(record, known):
                merged[key] = record
        return list(merged.values())

    async def flush(self) -> None:
        """Wait until everything queued before this call is on disk (tests, shutdown).

        While the database refuses writes this waits for the writer's retries;
        bound it with ``asyncio.timeout`` where that matters.
        """
        self.check_open()
        await self._drain()

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Write what is pending (for up to ``timeout_s``), stop the writer, close; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(timeout_s):
                await self._drain()
        except TimeoutError:
            logger.error(
                "{} {}: {} {}(s) not written within {}s of shutdown; lost",
                self.what,
                self.path,
                len(self._pending) + len(self._in_flight),
                self.noun,
                timeout_s,
            )
        except self.error:
            logger.error("{} {}: writer stopped; pending records lost", self.what, self.path)
        finally:
            await self._stop_writer()
            await self._close_backend()

    # -- internals ---------------------------------------------------------------

    def _writer_ended(self) -> None:
        self._fail_waiters(list(self._waiters), "the writer has stopped")
        self._notify()

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _oldest_unwritten(self) -> int | None:
        for entries in (self._in_flight, self._pending):
            for seq, _ in entries.values():
                return seq
        return None

    def _shed(self) -> None:
        """Drop a tenth of the pending records, those ``_shed_first`` picks first.

        Reached only when the database has refused writes for a long time;
        dropping in chunks keeps this scan and its log line rare.
        """
        wanted = max(len(self._pending) - self._max_pending, self._max_pending // 10, 1)
        entries = self._pending.items()
        first = (key for key, (_, r) in entries if self._shed_first(r))
        keys = list(itertools.islice(first, wanted))
        if len(keys) < wanted:
            rest = (key for key, (_, r) in entries if not self._shed_first(r))
            keys.extend(itertools.islice(rest, wanted - len(keys)))
        entries_dropped = [self._pending.pop(key) for key in keys]
        victims = [record for _, record in entries_dropped]
        self._fail_waiters([seq for seq, _ in entries_dropped], f"{self.noun} dropped")
        self.dropped += len(victims)
        logger.error(
            "{} {}: {} to bound memory; the database has refused writes for a while",
            self.what,
            self.path,
            self._shed_note(victims),
        )
        self._notify()

    async def _drain(self) -> None:
        """Wait until every record queued before this call is written (or dropped)."""
        target = self._seq
        self._drains += 1
        try:
            while (oldest := self._oldest_unwritten()) is not None and oldest <= target:
                if self._writer is None or self._writer.done():
                    raise self.error(f"{self.what} {self.path}: the writer has stopped")
                self._urgent.set()
                self._wake.set()
                await self._progress.wait()
        finally:
            self._drains -= 1

    async def _write_forever(self) -> None:
        """The one task that writes: gather, commit the oldest pending records in one
        transaction, repeat; back off on failure.

        Records gather for ``flush_interval_s`` (less if a flush is waiting) before the
        first batch and before each batch that follows a full one's commit while fewer
        than ``max_batch`` wait: under steady traffic one transaction per interval, not
        one per record (each a thread round trip, a commit, GIL handoffs). A retry after
        a failed write gathers nothing: its pause was the wait. A batch is ``_in_flight``
        while it commits (``unwritten`` lists it); a failed or cancelled one goes back in
        front (``_restore``), a written one releases what waited for it (``_written``).
        """
        failures = 0
        while True:
            await self._wake.wait()
            gather = True
            while self._pending:
                if gather:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._flush_interval_s):
                            await self._urgent.wait()
                oldest = list(itertools.islice(self._pending, self._max_batch))
                batch = self._in_flight = {key: self._pending.pop(key) for key in oldest}
                written = False
                try:
                    async with self._write_lock:
                        await self._commit([self._row(r) for _, r in batch.values()])
                    written = True
                except asyncio.CancelledError:
                    self._restore(batch)
                    raise
                except Exception:
                    self._failed(batch)
                finally:
                    self._in_flight = {}
                if written:
                    self.writes += 1
                    if self._waiters or self._drains:  # only a persist or a flush waits
                        self._written(batch)
                    failures = 0
                    gather = len(self._pending) < self._max_batch
                    continue
                failures += 1
                gather = False
                delay = min(self._retry_delay_s * 2 ** min(failures - 1, 16), MAX_RETRY_DELAY_S)
                # Not cut short by flush(): a refusing disk must not turn into a busy loop.
                await asyncio.sleep(delay)
            # No await since the loop condition: nothing can have arrived in between.
            self._wake.clear()
            self._urgent.clear()

    def _failed(self, batch: dict[str, tuple[int, R]]) -> None:
        """A batch the database refused: logged, and kept in front for the retry."""
        self.failed_writes += 1
        logger.exception(
            "{} {}: writing {} {}(s) failed; keeping them for a retry",
            self.what,
            self.path,
            len(batch),
            self.noun,
        )
        self._restore(batch)

    def _written(self, batch: dict[str, tuple[int, R]]) -> None:
        """A committed batch: its records' ``persist`` calls return, a waiting flush looks."""
        for seq, _ in batch.values():
            for waiter in self._waiters.pop(seq, ()):
                if not waiter.done():
                    waiter.set_result(None)
        if self._drains:
            self._notify()

    def _fail_waiters(self, seqs: list[int], why: str) -> None:
        for seq in seqs:
            for waiter in self._waiters.pop(seq, ()):
                if not waiter.done():
                    waiter.set_exception(self.error(f"{self.what} {self.path}: {why}"))

    def _restore(self, batch: dict[str, tuple[int, R]]) -> None:
        """Put a failed batch back in front, unless a newer change of the same id arrived."""
        kept = {
            key: entry
            for key, entry in batch.items()
            if key not in self._pending or not self._supersedes(self._pending[key][1], entry[1])
        }
        for key, (seq, _) in batch.items():
            if key not in kept and seq in self._waiters:
                # Replaced while it was being written: what waited for it waits for the newer.
                newer = self._pending[key][0]
                self._waiters.setdefault(newer, []).extend(self._waiters.pop(seq))
        for key in kept:
            self._pending.pop(key, None)
        self._pending = {**kept, **self._pending}

    async def _stop_writer(self) -> None:
        """Cancel the writer (logging it if it had failed); let any waiting flush see the end."""
        writer, self._writer = self._writer, None
        await cancel_and_wait(writer)
        self._fail_waiters(list(self._waiters), "the writer has stopped")
        self._notify()


class BatchedWriter(QueuedWriter[R]):
    """A ``QueuedWriter`` committing to one aiosqlite connection, which it closes."""

    path: Path

    def __init__(self, db: aiosqlite.Connection, path: Path, tuning: WriterTuning) -> None:
        """Wire the state; ``start`` starts the writer (a subclass may read first)."""
        super().__init__(path, tuning)
        self._db = db

    async def _commit(self, rows: list[tuple[object, ...]]) -> None:
        async with transaction(self._db):
            await self._db.executemany(self.statement, rows)

    async def _close_backend(self) -> None:
        await self._db.close()
