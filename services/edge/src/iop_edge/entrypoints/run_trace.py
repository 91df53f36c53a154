"""What one inference request went through, gathered as it happens, recorded once.

Handlers note facts (dispatched, started, first delta, completed, failed, client
gone) as they occur; at the end ``record()`` and ``observe()`` turn them into the
``EdgeRunRecord`` and the metrics, whatever way the request ended.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from iop_edge.domain.events import Completed, Started
from iop_edge.domain.fleet import Operation
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.errors import EdgeError
from iop_edge.ports import EdgeRunRecord, RunEvents

CLIENT_CLOSED = 499
"""The status recorded when the client left before any response was sent (nginx's)."""
OVERHEAD_HEADER = "x-iop-overhead-ms"


@dataclass(slots=True)
class RunTrace:
    """The mutable facts of one request; times from ``time.monotonic()``."""

    operation: Operation
    received_ms: int  # Unix ms, for the record
    received_at: float  # monotonic, for durations
    created: int  # Unix s, the ``created`` of OpenAI objects
    model: str = ""  # the public model id, once the catalog knows it (metric label)
    key_id: str = ""  # the caller's API key, once authenticated ("" while the API is open)
    stream: bool = False
    run_id: str = ""  # set once RunService dispatched the request
    run: RunEvents | None = None  # the dispatched run: its attempts, for the record
    local_id: str = ""  # the log's id for a request that never became a run
    provider_id: str = ""
    node_id: str = ""
    edge_wait_s: float = 0.0  # inside the run's open (RunEvents.open): the model's queue
    node_wait_ms: int = 0  # the node's FIFO queue (RunStart)
    first_delta_at: float = 0.0
    outcome: str = ""
    status: int = 0
    error_code: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    provider_s: float = 0.0  # the node's wait on the provider, as its last event said
    overhead_s: float | None = None  # what x-iop-overhead-ms said, once it was sent
    headers: dict[str, str] = field(default_factory=dict)  # every answer adds (clamp, dialect's)

    @classmethod
    def begin(cls, operation: Operation) -> RunTrace:
        now = time.time()
        return cls(
            operation=operation,
            received_ms=int(now * 1000),
            received_at=time.monotonic(),
            created=int(now),
        )

    @property
    def request_id(self) -> str:
        """The run id once dispatched; a rejected request gets its own id for the log."""
        if self.run_id:
            return self.run_id
        if not self.local_id:
            self.local_id = "req-" + uuid.uuid4().hex
        return self.local_id

    def dispatched(self, events: RunEvents, edge_wait_s: float) -> None:
        self.run = events
        self.run_id = events.run_id
        self.provider_id = events.provider_id
        self.node_id = events.node_id
        self.edge_wait_s = edge_wait_s

    def started(self, start: Started) -> None:
        self.node_wait_ms = start.queue_wait_ms
        self.provider_id = start.provider_id or self.provider_id

    def overhead(self, provider_us: int | None = None) -> str:
        """``x-iop-overhead-ms``: the time since the request arrived, less the provider's
        (``provider_us`` from the node's event, when given), in ms; kept for the metric.

        Taken when the response head leaves: for a stream that is its first byte, so the
        value is the overhead up to the first byte; otherwise the whole response's.
        Failed attempts of a failover, and queueing for a free slot, count as overhead.
        """
        if provider_us is not None:
            self.provider_s = provider_us / 1_000_000
        spent = time.monotonic() - self.received_at - self.provider_s
        self.overhead_s = spent if spent > 0.0 else 0.0
        return f"{self.overhead_s * 1000:.3f}"

    def first_delta(self) -> None:
        if not self.first_delta_at:
            self.first_delta_at = time.monotonic()

    def restarted(self) -> None:
        """A non-streamed run failed over: its time to first token is the next attempt's."""
        self.first_delta_at = 0.0

    def completed(self, complete: Completed) -> None:
        self.outcome = "completed"
        if complete.usage is not None:
            self.prompt_tokens = complete.usage.prompt_tokens
            self.completion_tokens = complete.usage.completion_tokens
            self.cached_tokens = complete.usage.cached_tokens

    def failed(self, exc: EdgeError, *, status: int) -> None:
        """The request ended in ``exc``; ``status`` is what the client got (200 mid-stream)."""
        # Nothing dispatched: the edge turned it away (auth, validation, queue full ...).
        self.outcome = "failed" if self.run_id else "rejected"
        self.status = status
        self.error_code = exc.code or exc.type

    def client_gone(self) -> None:
        """The client disconnected; a response already started keeps its status."""
        if self.outcome in ("completed", "failed"):
            return  # the run had ended: only the last bytes were lost
        self.outcome = "cancelled"
        self.status = self.status or CLIENT_CLOSED
        self.error_code = "client_disconnected"

    def crashed(self, *, status: int = 500) -> None:
        """An unexpected exception: the boundary answers 500 (or the stream ends, 200)."""
        self.outcome = "failed"
        self.status = status
        self.error_code = "internal_error"

    def record(self) -> EdgeRunRecord:
        # 0 means "did not happen" in the record: anything that happened is at least 1 ms.
        ttft_ms = _ms(self.first_delta_at - self.received_at) if self.first_delta_at else 0
        run = self.run
        attempts = run.attempt_records() if run is not None else ()
        last = attempts[-1] if attempts else None  # who served it (after a failover too)
        return EdgeRunRecord(
            run_id=self.request_id,
            model=self.model,
            provider_id=self.provider_id if last is None else last.provider_id,
            node_id=self.node_id if last is None else last.node_id,
            operation=self.operation.value,
            stream=self.stream,
            outcome=self.outcome or "failed",
            status=self.status or 500,
            error_code=self.error_code,
            received_ms=self.received_ms,
            queue_wait_ms=self.queue_wait_ms,
            ttft_ms=ttft_ms,
            duration_ms=_ms(time.monotonic() - self.received_at),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            key_id=self.key_id,
            attempts=attempts,
            cached_tokens=self.cached_tokens,
        )

    def _served_by(self) -> str:
        """The provider that answered (the last attempt's, after a failover): the run
        names it without building its attempts' records, which ``record`` does once."""
        return self.run.provider_id if self.run is not None else self.provider_id

    @property
    def queue_wait_ms(self) -> int:
        return round(self.edge_wait_s * 1000) + self.node_wait_ms

    def observe(self, metrics: ApiMetrics) -> None:
        series = metrics.model(self.model)
        series.requests(self.status or 500).inc()
        series.duration.observe(time.monotonic() - self.received_at)
        if self.run_id:
            series.queue_wait.observe(self.queue_wait_ms / 1000)
        if self.first_delta_at:
            series.ttft.observe(self.first_delta_at - self.received_at)
        if self.overhead_s is not None:
            metrics.overhead_of(self.operation.value, self.stream).observe(self.overhead_s)
        if self.outcome == "completed" and (served_by := self._served_by()):
            tokens = metrics.tokens_of(self.model, served_by)
            tokens.prompt.inc(self.prompt_tokens)
            tokens.completion.inc(self.completion_tokens)
            tokens.cached.inc(self.cached_tokens)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
