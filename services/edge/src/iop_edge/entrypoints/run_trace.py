"""What one inference request went through, gathered as it happens, recorded once.

Handlers note facts (the run once dispatched, its first delta, completion, failure,
a client gone) as they occur; at the end ``account()`` turns them into the metrics and the
``EdgeRunRecord`` it records, whatever way the request ended.
"""

from __future__ import annotations

import time
import uuid

from opentelemetry.trace import Span

from iop_edge.domain.events import Completed
from iop_edge.domain.fleet import Operation
from iop_edge.domain.usage import Api
from iop_edge.entrypoints.api_metrics import ApiMetrics, ModelSeries
from iop_edge.entrypoints.run_span import close_span
from iop_edge.errors import EdgeError
from iop_edge.ports import EdgeRunRecord, RunEvents, RunLog
from iop_proto.service.logging import log_unexpected
from iop_proto.tracing import trace_id

CLIENT_CLOSED = 499
"""The status recorded when the client left before any response was sent (nginx's)."""
OVERHEAD_HEADER = "x-iop-overhead-ms"


class RunTrace:
    """The mutable facts of one request; times from ``time.monotonic()``."""

    __slots__ = (
        "api",
        "cached_tokens",
        "completion_tokens",
        "created",
        "edge_wait_s",
        "error_code",
        "first_delta_at",
        "headers",
        "key_id",
        "local_id",
        "model",
        "operation",
        "outcome",
        "overhead_s",
        "prompt_tokens",
        "provider_s",
        "received_at",
        "received_ms",
        "run",
        "run_id",
        "series",
        "span",
        "status",
        "stream",
    )

    def __init__(self, operation: Operation, api: Api) -> None:
        """The trace of a request received now, through ``api``."""
        now = time.time()
        self.operation = operation
        self.api = api
        self.received_ms = int(now * 1000)  # Unix ms, for the record
        self.received_at = time.monotonic()  # for durations
        self.created = int(now)  # Unix s, the ``created`` of OpenAI objects
        self.model = ""  # the public model id, once the catalog knows it (metric label)
        self.series: ModelSeries | None = None  # that model's metrics
        self.key_id = ""  # the caller's API key, once authenticated ("" while the API is open)
        self.stream = False
        self.run_id = ""  # set once RunService dispatched the request, with:
        self.run: RunEvents | None = None  # the dispatched run: its attempts, for the record
        self.local_id = ""  # the log's id for a request that never became a run
        self.edge_wait_s = 0.0  # inside the run's open (RunEvents.open): the model's queue
        self.first_delta_at = 0.0  # a stream's relay sets it, a collector by first_delta()
        self.outcome = ""
        self.status = 0
        self.error_code = ""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.provider_s = 0.0  # the node's wait on the provider, as its last event said
        self.overhead_s: float | None = None  # what x-iop-overhead-ms said, once it was sent
        self.headers: dict[str, str] = {}  # every answer adds them (clamp, dialect's)
        self.span: Span | None = None  # its span while tracing is on (run_span)

    @property
    def request_id(self) -> str:
        """The run id once dispatched; a rejected request gets its own id for the log."""
        if self.run_id:
            return self.run_id
        if not self.local_id:
            self.local_id = "req-" + uuid.uuid4().hex
        return self.local_id

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

    def account(self, metrics: ApiMetrics, runlog: RunLog) -> None:
        """The request's end in the metrics, and its record in the run log: called once,
        whatever way the request ended; a failing run log never fails the request."""
        ended_at = time.monotonic()
        received_at = self.received_at
        operation = self.operation.value
        status = self.status or 500
        series = self.series if self.series is not None else metrics.models[self.model]
        series.duration.observe(ended_at - received_at)
        run = self.run
        queue_wait_ms = round(self.edge_wait_s * 1000)
        if run is not None:  # dispatched: the node's queue too
            queue_wait_ms += run.node_wait_ms
            series.queue_wait.observe(queue_wait_ms / 1000)
        # 0 means "did not happen" in the record: anything that happened is at least 1 ms.
        ttft_ms = 0
        if self.first_delta_at:
            ttft_s = self.first_delta_at - received_at
            series.ttft.observe(ttft_s)
            ttft_ms = max(1, round(ttft_s * 1000))
        if self.overhead_s is not None:
            metrics.overheads[operation, self.stream].observe(self.overhead_s)
        attempts = run.attempt_records() if run is not None else ()
        if attempts:  # who served it: the last attempt (after a failover too)
            provider_id, node_id = attempts[-1].provider_id, attempts[-1].node_id
        elif run is not None:
            provider_id, node_id = run.provider_id, run.node_id
        else:
            provider_id = node_id = ""  # never dispatched
        outcome = self.outcome or "failed"
        record = EdgeRunRecord(
            run_id=self.run_id or self.request_id,
            model=self.model,
            provider_id=provider_id,
            node_id=node_id,
            operation=operation,
            stream=self.stream,
            outcome=outcome,
            status=status,
            error_code=self.error_code,
            received_ms=self.received_ms,
            queue_wait_ms=queue_wait_ms,
            ttft_ms=ttft_ms,
            duration_ms=max(1, round((ended_at - received_at) * 1000)),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            key_id=self.key_id,
            attempts=attempts,
            cached_tokens=self.cached_tokens,
            api=self.api.value,
            trace_id="" if self.span is None else trace_id(self.span),
        )
        if self.span is not None:
            close_span(self.span, record)
        metrics.count(record)  # requests and tokens by model, provider, key and API
        try:
            # Synchronous (record() only queues), so even a second cancellation (server
            # shutdown) cannot cut it short: no shield (and no task per request) needed.
            runlog.record(record)
        except Exception as exc:
            log_unexpected(exc, "could not record run {}", record.run_id)
