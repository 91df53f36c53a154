"""The lease loop: lease a batch, run its lines a bounded number at a time, renew, release.

One ``run(edge)`` lives as long as one registered connection. Recovery leans on
the edge's lease: whenever this worker cannot vouch for every line of a batch
(connection lost, lease lost, a line without a result, shutdown), it simply
does not release it, and the edge hands the batch out again from its first
unfinished line once the lease expires (at once when the connection it was
granted on ends). Only a batch whose every line was answered is released, as
finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from loguru import logger

from iop_worker.domain.batches import BatchProgress, Lease
from iop_worker.errors import EdgeLinkLost, EdgeRefused, LeaseLost
from iop_worker.metrics import WorkerMetrics
from iop_worker.ports import EdgePort


class BatchRunner:
    """Leases batches from the edge and runs their lines, at most ``concurrency`` at once."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        *,
        concurrency: int,
        poll_interval_s: float,
        renew_interval_s: float,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self._metrics = metrics
        self._concurrency = concurrency
        self._poll_interval_s = poll_interval_s
        self._renew_interval_s = renew_interval_s
        self._stopping = asyncio.Event()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Lease nothing more and dispatch no new line; ``run`` returns once lines in flight end."""
        self._stopping.set()

    async def run(self, edge: EdgePort) -> None:
        """Lease and run batches until stopped.

        Raises ``EdgeLinkLost`` when the connection goes; the batch in hand is
        then abandoned without a release (its lease expires at the edge).
        """
        while not self._stopping.is_set():
            lease = await self._lease(edge)
            if lease is None:
                await self._pause(self._poll_interval_s)
            else:
                await self._run_batch(edge, lease)

    async def _lease(self, edge: EdgePort) -> Lease | None:
        try:
            return await edge.lease()
        except TimeoutError:
            logger.warning("the edge did not answer a lease request in time")
        except EdgeRefused as exc:
            logger.warning("the edge refused a lease request: {}", exc)
        return None

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on ``stop()``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    # ------------------------------------------------------------ one batch

    async def _run_batch(self, edge: EdgePort, lease: Lease) -> None:
        progress = BatchProgress(lease)
        # Never the lease id at INFO: it is the handle this connection acts on the batch with.
        logger.info(
            "leased batch {} ({}): lines {}..{}",
            lease.batch_id,
            lease.endpoint,
            lease.next_line,
            lease.total_lines - 1,
        )
        self._warn_if_lease_outlives_no_renewal(lease)
        outcome = "lost"
        try:
            await self._dispatch(edge, progress)
            if progress.finished:
                await edge.release(lease, finished=True)
                outcome = "finished"
        finally:
            self._metrics.batches.labels(outcome=outcome).inc()
            self._log_end(progress, outcome)

    async def _dispatch(self, edge: EdgePort, progress: BatchProgress) -> None:
        """Run the lease's lines with a fixed pool of workers, renewing alongside.

        The workers share one iterator of line numbers, so each line is taken
        exactly once and never more than ``concurrency`` are in flight.
        """
        lease = progress.lease
        lines = iter(range(lease.next_line, lease.total_lines))
        try:
            async with asyncio.TaskGroup() as group:
                renewer = group.create_task(
                    self._renew(edge, progress), name=f"renew:{lease.lease_id}"
                )
                workers = [
                    group.create_task(
                        self._work(edge, progress, lines), name=f"lines:{lease.lease_id}:{n}"
                    )
                    for n in range(min(self._concurrency, lease.remaining))
                ]
                if workers:
                    await asyncio.wait(workers)
                renewer.cancel()
        except* EdgeLinkLost as lost:
            # The connection took every request down at once: report it as itself.
            raise lost.exceptions[0] from None

    async def _work(self, edge: EdgePort, progress: BatchProgress, lines: Iterator[int]) -> None:
        while not progress.halted and not self._stopping.is_set():
            line = next(lines, None)
            if line is None:
                return
            await self._run_line(edge, progress, line)

    async def _run_line(self, edge: EdgePort, progress: BatchProgress, line: int) -> None:
        lease = progress.lease
        self._metrics.lines_in_flight.inc()
        try:
            result = await edge.run_line(lease, line)
        except LeaseLost as exc:
            self._lose(progress, f"line {line} refused: {exc}")
            return
        except (TimeoutError, EdgeRefused) as exc:
            reason = str(exc) or "no answer in time"
            logger.error("batch {} line {} got no result: {}", lease.batch_id, line, reason)
            self._metrics.lines.labels(outcome="failed").inc()
            progress.give_up_line(f"line {line} got no result ({reason})")
            return
        finally:
            self._metrics.lines_in_flight.dec()
        progress.record(result)
        self._metrics.lines.labels(outcome="done" if result.ok else "failed").inc()

    async def _renew(self, edge: EdgePort, progress: BatchProgress) -> None:
        """Renew every interval until cancelled (all lines ended) or the lease is lost."""
        lease = progress.lease
        while True:
            await asyncio.sleep(self._renew_interval_s)
            try:
                await edge.renew(lease)
            except LeaseLost as exc:
                self._lose(progress, f"renewal refused: {exc}")
                return
            except (TimeoutError, EdgeRefused) as exc:
                # Not a verdict on the lease: try again; a real loss shows on the next one.
                logger.warning(
                    "renewing the lease of batch {} failed: {}", lease.batch_id, exc or "timeout"
                )
                continue
            self._metrics.lease_renewals.inc()

    def _lose(self, progress: BatchProgress, reason: str) -> None:
        if progress.lose_lease(f"lease lost ({reason})"):
            self._metrics.leases_lost.inc()
            logger.warning(
                "the lease of batch {} lost: {}; no new lines of it",
                progress.lease.batch_id,
                reason,
            )

    # ------------------------------------------------------------ reporting

    def _warn_if_lease_outlives_no_renewal(self, lease: Lease) -> None:
        if not lease.expires_at_unix_ms:
            return
        left_s = lease.expires_at_unix_ms / 1000 - time.time()
        if left_s < self._renew_interval_s:
            logger.warning(
                "the lease of batch {} expires in {:.1f}s, before its first renewal ({}s): "
                "lower lease_renew_interval_s",
                lease.batch_id,
                left_s,
                self._renew_interval_s,
            )

    def _log_end(self, progress: BatchProgress, outcome: str) -> None:
        lease = progress.lease
        counts = f"{progress.done} done, {progress.failed} failed of {lease.remaining}"
        if outcome == "finished":
            logger.info("batch {} finished: {}", lease.batch_id, counts)
            return
        reason = progress.halt_reason or (
            "stopping" if self._stopping.is_set() else "the edge connection ended"
        )
        logger.warning("batch {} left to its lease expiry ({}): {}", lease.batch_id, reason, counts)
