"""The worker side of batches: leases, line runs, and the end of a batch.

Leases: one live lease per batch, so under normal operation no line runs
twice; a worker that goes quiet loses its lease at expiry and the next worker
resumes at the first unfinished line. A line already finished is answered
from storage, never run again, and the same line asked twice at once shares
one run. Lease changes (lease, renew, release, cancel) are serialised by one
lock within this edge; line runs are not, they go concurrently. Several edges
may share the store (PostgreSQL): there the store's steps are conditional
(a lease is set only while free, renewed or freed only by its holder, a batch
frozen and ended once), so what one edge decided from a stale read changes
nothing the other did.

The end of a batch is two steps: ``begin_finalize`` freezes it (no lease, no
more line results, its runs stopped), then the result files and the final
status are written in one transaction. A crash in between leaves it frozen,
and the next ``lease`` finishes the job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from loguru import logger

from iop_edge.batch_ports import BatchStore
from iop_edge.domain.batches import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    IN_PROGRESS,
    RUNNABLE,
    BatchRecord,
    FileRecord,
    LineRecord,
    LineResult,
    new_id,
    result_files,
)
from iop_edge.domain.leases import LeaseGrant, LineReply
from iop_edge.errors import LeaseLost, NotFound
from iop_edge.metrics import BatchMetrics
from iop_edge.service.batch_lines import LineRunner


class BatchWork:
    """Implements ``BatchLeases`` (through ``BatchService``) and lease-aware cancel."""

    def __init__(
        self,
        store: BatchStore,
        runner: LineRunner,
        metrics: BatchMetrics,
        *,
        lease_ttl_s: float,
        clock: Callable[[], float],
        retry_delay_s: float,
    ) -> None:
        self._store = store
        self._runner = runner
        self._metrics = metrics
        self._ttl_s = lease_ttl_s
        self._clock = clock
        self._retry_delay_s = retry_delay_s
        self._lock = asyncio.Lock()  # lease, renew, release, cancel: one at a time
        self._finalizing: set[str] = set()  # batch ids whose result files are being written
        # Lines being run, so the same line asked twice shares one run: (custom_id, result).
        self._running: dict[tuple[str, int], asyncio.Future[tuple[str, LineResult]]] = {}

    def _now(self) -> int:
        return int(self._clock())

    async def worker_registered(self, worker_id: str) -> None:
        """A worker (re)connected while no other connection of it is live: the leases it
        held died with its old connection (or with the edge, before a restart).

        Without this an edge restart would stall each running batch until its lease
        expired; freeing them lets the batch be leased again at once (finished lines
        are stored, so nothing runs twice). The node server does not call this while
        another connection of the worker lives: that one's leases stay its own.
        """
        async with self._lock:
            freed = await self._store.free_leases_of(worker_id)
        if freed:
            logger.info("worker {} reconnected: {} leases it held are free again", worker_id, freed)

    async def connection_ended(self, worker_id: str, lease_ids: Iterable[str]) -> None:
        """A worker's connection ended (its lines in flight stopped with it): the leases
        granted on it are free at once, not at their expiry. The worker abandons a lease
        with its connection (it never renews one on another), so nobody would use it
        again; one released, expired and taken over meanwhile is left alone."""
        freed = 0
        async with self._lock:
            for lease_id in lease_ids:
                batch = await self._store.batch_by_lease(lease_id)
                if batch is not None and batch.lease_owner == worker_id:
                    await self._store.free_lease(batch.id, lease_id)
                    freed += 1
        if freed:
            logger.info(
                "worker {}: a connection ended; {} batches it held are free", worker_id, freed
            )

    async def lease(self, worker_id: str) -> LeaseGrant:
        """The oldest batch with work and no live lease; an empty grant when there is none.

        Also ends what is due: cancelling batches whose worker went quiet, batches
        past their completion window, finalizes a crash interrupted.
        """
        grant = LeaseGrant()
        async with self._lock:
            now = self._clock()
            due = await self._claim_due(now)
            # Another edge may lease the batch found between the read and the write: the
            # store then refuses, that batch's lease is live, and the next read skips it.
            while (batch := await self._store.leasable(now)) is not None:
                lease_id = new_id("lease_")
                expires_at = now + self._ttl_s
                if not await self._store.set_lease(batch.id, lease_id, worker_id, expires_at, now):
                    continue
                self._count_expiry(batch)
                grant = await self._grant(batch, lease_id, expires_at)
                # The lease id at DEBUG only: it is the handle a worker's connection acts
                # on its batch with (``PeerGuard`` also checks who holds it).
                logger.info("batch {}: leased to {}", batch.id, worker_id)
                logger.debug("batch {}: lease {}", batch.id, lease_id)
                break
        await self._finalize(due)
        await self.refresh_metrics()
        return grant

    async def renew(self, lease_id: str) -> LeaseGrant:
        """Extend a lease; ``LeaseLost`` when it is no longer the batch's, or the batch is
        cancelling or past its window (the worker stops; the edge ends the batch)."""
        due: list[tuple[str, str]] = []
        async with self._lock:
            batch = await self._held(lease_id)
            now = self._clock()
            if now < batch.expires_at:
                expires_at = now + self._ttl_s
                if not await self._store.extend_lease(batch.id, lease_id, expires_at):
                    raise LeaseLost(f"lease {lease_id} was taken over by another worker")
                self._metrics.lease_renewals.inc()
                return await self._grant(batch, lease_id, expires_at)
            if await self._begin_finalize(batch.id, EXPIRED):
                due.append((batch.id, EXPIRED))
        await self._finalize(due)
        await self.refresh_metrics()
        raise LeaseLost(f"batch {batch.id} passed its completion window and has expired")

    async def release(self, lease_id: str, finished: bool) -> None:
        """The worker is done with the batch. Finished (nothing pending), cancelling, or
        past its window: finalize. Lines left pending: free the batch for a later lease."""
        async with self._lock:
            batch = await self._store.batch_by_lease(lease_id)
            if batch is None:
                return  # already taken over, or released twice: nothing of ours to free
            pending = await self._store.first_pending(batch.id)
            if batch.status == CANCELLING:
                terminal: str | None = CANCELLED
            elif pending is None:
                terminal = COMPLETED
            elif self._clock() >= batch.expires_at:
                terminal = EXPIRED
            else:
                terminal = None
                rest = self._clock() + self._retry_delay_s if finished else None
                await self._store.free_lease(batch.id, lease_id, rest)
            if terminal is not None and not await self._begin_finalize(batch.id, terminal):
                terminal = None  # frozen or ended meanwhile, by another edge
        if terminal is not None:
            await self._finalize([(batch.id, terminal)])
        await self.refresh_metrics()

    async def cancel(self, batch_id: str) -> None:
        """``cancelling`` while a worker holds the batch (it learns at its next renewal or
        line, and the lines it has in flight may still finish), ``cancelled`` at once
        otherwise. A batch past running is left as is."""
        await self._cancel([batch_id], at_once=False)

    async def cancel_at_once(self, batch_ids: Iterable[str]) -> list[str]:
        """Cancel these batches, each ``cancelled`` before this returns even while a worker
        holds it (also one ``cancelling`` already): lines in flight are stopped and stay
        unfinished. For the batches of a revoked key, whose work must not wait on a
        worker. All are frozen under one hold of the lock before any is finalized, so a
        worker cannot lease one while another's files are written. Returns those this
        call cancelled (one past running is left as is)."""
        return await self._cancel(batch_ids, at_once=True)

    async def _cancel(self, batch_ids: Iterable[str], *, at_once: bool) -> list[str]:
        cancellable = (*RUNNABLE, CANCELLING) if at_once else RUNNABLE
        cancelled: list[str] = []
        due: list[tuple[str, str]] = []
        async with self._lock:
            for batch_id in batch_ids:
                batch = await self._store.get_batch(batch_id)
                if batch is None or batch.status not in cancellable or batch.finalize_as:
                    continue
                if batch.status != CANCELLING:
                    await self._store.mark_cancelling(batch_id, self._now())
                cancelled.append(batch_id)
                if (at_once or not self._lease_live(batch)) and await self._begin_finalize(
                    batch_id, CANCELLED
                ):
                    self._count_expiry(batch)
                    due.append((batch_id, CANCELLED))
        await self._finalize(due)
        if cancelled:
            await self.refresh_metrics()
        return cancelled

    async def run_line(self, lease_id: str, line_number: int) -> LineReply:
        """Run one line (0-based) under the lease, or answer it from storage if finished.

        A status 429 or 503 in the answer with the line still pending means the
        fleet had no room for it (or it was cancelled from the edge's side): the
        worker may retry it later; releasing the batch as finished retries it
        with the next lease.
        """
        while True:
            batch = await self._held(lease_id)
            if not 0 <= line_number < batch.total:
                raise NotFound(f"Batch {batch.id} has no line {line_number}", param="line_number")
            key = (batch.id, line_number)
            running = self._running.get(key)
            if running is None:
                break
            await asyncio.wait([running])  # the same line asked twice: share its one run
            if not running.cancelled():
                return _line_result(lease_id, line_number, *running.result())
        future: asyncio.Future[tuple[str, LineResult]] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            line, result = await self._run_line(batch, line_number)
        except BaseException:
            future.cancel()  # a waiter for the same line tries again itself
            raise
        finally:
            del self._running[key]
        future.set_result((line.custom_id, result))
        return _line_result(lease_id, line_number, line.custom_id, result)

    async def _run_line(self, batch: BatchRecord, index: int) -> tuple[LineRecord, LineResult]:
        line = await self._store.get_line(batch.id, index)
        if line is None:
            raise NotFound(f"Batch {batch.id} has no line {index}", param="line_number")
        if line.result is not None:
            return line, line.result
        outcome = await self._runner.run(
            batch.endpoint, line, new_id("batch_req_"), batch.owner or ""
        )
        if outcome.transient:
            return line, outcome.result
        if await self._store.finish_line(batch.id, index, outcome.result, self._now()):
            self._metrics.lines.labels(outcome.result.state).inc()
            return line, outcome.result
        stored = await self._store.get_line(batch.id, index)  # finished meanwhile, or frozen
        return line, stored.result if stored and stored.result else outcome.result

    async def lease_holder(self, lease_id: str) -> str | None:
        """The worker the lease was granted to, while a batch holds it. A lease id is
        never handed to another worker (each lease gets a new id), so the answer cannot
        change to another worker's later: the ownership check needs no lock."""
        batch = await self._store.batch_by_lease(lease_id)
        return None if batch is None else batch.lease_owner

    async def _held(self, lease_id: str) -> BatchRecord:
        batch = await self._store.batch_by_lease(lease_id)
        if batch is None:
            raise LeaseLost(f"lease {lease_id} is not held (expired and taken, or released)")
        if batch.status == CANCELLING:
            raise LeaseLost(f"batch {batch.id} is being cancelled")
        if batch.status != IN_PROGRESS or batch.finalize_as is not None:
            raise LeaseLost(f"batch {batch.id} is {batch.status}")
        return batch

    async def _grant(self, batch: BatchRecord, lease_id: str, expires_at: float) -> LeaseGrant:
        first = await self._store.first_pending(batch.id)
        return LeaseGrant(
            batch_id=batch.id,
            lease_id=lease_id,
            expires_at_unix_ms=int(expires_at * 1000),
            endpoint=batch.endpoint,
            next_line=batch.total if first is None else first,
            total_lines=batch.total,
        )

    def _lease_live(self, batch: BatchRecord) -> bool:
        expires = batch.lease_expires_at
        return batch.lease_id is not None and expires is not None and expires > self._clock()

    def _count_expiry(self, batch: BatchRecord) -> None:
        """A lease still on the batch but not live: its worker went quiet."""
        if batch.lease_id is not None and not self._lease_live(batch):
            self._metrics.lease_expiries.inc()
            logger.warning("batch {}: the lease of worker {} expired", batch.id, batch.lease_owner)

    # ------------------------------------------------------------------ the end of a batch

    async def _claim_due(self, now: float) -> list[tuple[str, str]]:
        """Begin finalizing every batch whose end is due (under the lock)."""
        due: list[tuple[str, str]] = []
        for batch in await self._store.to_finalize(now):
            if batch.finalize_as is not None:
                if batch.id not in self._finalizing:  # begun before a crash
                    self._finalizing.add(batch.id)
                    due.append((batch.id, batch.finalize_as))
                continue
            terminal = CANCELLED if batch.status == CANCELLING else EXPIRED
            if await self._begin_finalize(batch.id, terminal):
                self._count_expiry(batch)
                due.append((batch.id, terminal))
        return due

    async def _begin_finalize(self, batch_id: str, terminal: str) -> bool:
        """Freeze the batch (no lease, no more line results) and stop its runs; False
        when it was frozen or ended already (by another edge sharing the store)."""
        if not await self._store.begin_finalize(batch_id, terminal, self._now()):
            return False
        self._finalizing.add(batch_id)
        await self._runner.cancel_batch(batch_id, f"the batch is {terminal}")
        return True

    async def _finalize(self, due: list[tuple[str, str]]) -> None:
        """Write result files and end each batch. One that fails stays frozen and is
        finalized again by the next ``lease``: the failure is logged, not raised, since
        the caller's own step (a cancel, a release) did succeed."""
        for batch_id, terminal in due:
            try:
                await self._write_results(batch_id, terminal)
            except Exception:
                logger.exception(
                    "batch {}: finalizing as {} failed; will retry", batch_id, terminal
                )
            finally:
                self._finalizing.discard(batch_id)

    async def _write_results(self, batch_id: str, terminal: str) -> None:
        """The output and error files, owned by the batch's owner (and no one else)."""
        batch = await self._store.get_batch(batch_id)
        owner = None if batch is None else batch.owner
        lines = await self._store.lines(batch_id)
        output, errors = await asyncio.to_thread(result_files, lines, terminal)
        now = self._now()
        files = [
            (
                FileRecord(
                    new_id("file-"), f"{batch_id}_{kind}.jsonl", "batch_output", len(c), now, owner
                ),
                c,
            )
            if c
            else None
            for kind, c in (("output", output), ("error", errors))
        ]
        if await self._store.end_batch(batch_id, terminal, now, files[0], files[1]):
            logger.info("batch {}: {} ({} lines)", batch_id, terminal, len(lines))
        else:  # another edge sharing the store finished the same finalize first
            logger.info("batch {}: ended by another edge", batch_id)

    async def refresh_metrics(self) -> None:
        """Publish the batches-by-status gauge (after every change; call once at start)."""
        for status, count in (await self._store.status_counts()).items():
            self._metrics.batches.labels(status).set(count)


def _line_result(lease_id: str, line_number: int, custom_id: str, result: LineResult) -> LineReply:
    return LineReply(
        lease_id=lease_id,
        line_number=line_number,
        custom_id=custom_id,
        status_code=result.status_code,
        response_json=(result.response or "").encode(),
        error_json=(result.error or "").encode(),
    )
