"""What one batch line's run went through, made into its run-log record at its end.

A batch line is a run like an HTTP request's, on the API ``batch`` and under the key
that owns the batch, so the run log, the metrics and the usage per key count it with
the rest (docs/ARCHITECTURE.md#usage-per-key). Every try of a line is recorded: one
the fleet had no room for (``rejected``) or that was stopped (``cancelled``) is run
again later, and its record says so.
"""

from __future__ import annotations

import time
import uuid

from iop_edge.domain.events import Completed
from iop_edge.domain.usage import Api
from iop_edge.errors import EdgeError
from iop_edge.ports import EdgeRunRecord, RunEvents, RunSpec

CLIENT_CLOSED = 499  # the worker left (its connection dropped), as a client that leaves


class LineTrace:
    """The facts of one line's run; times from ``time.monotonic()``."""

    __slots__ = (
        "end",
        "error_code",
        "key_id",
        "opened_at",
        "outcome",
        "received_at",
        "received_ms",
        "run",
        "spec",
        "status",
    )

    def __init__(self, key_id: str) -> None:
        """A line's run about to be made for the batch owner ``key_id`` ("" for nobody)."""
        self.key_id = key_id
        self.received_ms = int(time.time() * 1000)
        self.received_at = time.monotonic()
        self.spec: RunSpec | None = None  # once the line is read (its model is known)
        self.run: RunEvents | None = None  # once admitted
        self.opened_at = 0.0  # once the run had its provider
        self.end: Completed | None = None
        self.outcome = "failed"
        self.status = 500
        self.error_code = "internal_error"

    def opened(self) -> None:
        self.opened_at = time.monotonic()

    def completed(self, end: Completed) -> None:
        self.end = end
        self.outcome, self.status, self.error_code = "completed", 200, ""

    def failed(self, exc: EdgeError) -> None:
        # Not opened: the fleet had no room for it, or it was never a run (a bad line).
        if exc.code in ("cancelled", "preempted"):  # a preempted try runs again
            self.outcome = "cancelled"
        else:
            self.outcome = "failed" if self.opened_at else "rejected"
        self.status = exc.status
        self.error_code = exc.code or exc.type

    def crashed(self) -> None:
        """An unexpected exception in the edge (the line fails with a 500)."""
        self.outcome, self.status, self.error_code = "failed", 500, "internal_error"

    def abandoned(self) -> None:
        """The worker is gone: the line's run was cancelled."""
        self.outcome, self.status, self.error_code = "cancelled", CLIENT_CLOSED, "worker_gone"

    def record(self) -> EdgeRunRecord:
        """The line's record: the run log's, counted by the metrics as well."""
        ended_at = time.monotonic()
        run, spec, end = self.run, self.spec, self.end
        attempts = run.attempt_records() if run is not None else ()
        if attempts:
            provider_id, node_id = attempts[-1].provider_id, attempts[-1].node_id
        elif run is not None and self.opened_at:
            provider_id, node_id = run.provider_id, run.node_id
        else:
            provider_id = node_id = ""
        usage = end.usage if end is not None else None
        waited_until = self.opened_at or ended_at
        return EdgeRunRecord(
            run_id=run.run_id if run is not None else "req-" + uuid.uuid4().hex,
            model=spec.model if spec is not None else "",
            provider_id=provider_id,
            node_id=node_id,
            operation=spec.operation.value if spec is not None else "",
            stream=False,
            outcome=self.outcome,
            status=self.status,
            error_code=self.error_code,
            received_ms=self.received_ms,
            queue_wait_ms=round((waited_until - self.received_at) * 1000) if run is not None else 0,
            duration_ms=max(1, round((ended_at - self.received_at) * 1000)),
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            key_id=self.key_id,
            attempts=attempts,
            cached_tokens=usage.cached_tokens if usage is not None else 0,
            api=Api.BATCH.value,
        )
