"""The edge's span of one inference request (docs/ARCHITECTURE.md#traces).

Made only while tracing is on (``iop_proto.tracing``): begun once the request names a
model the edge serves, at the time the request arrived, and ended with what the run
log records of it, so the span and the run log's row say the same (the row keeps the
span's trace id). Its traceparent goes to the node in the run request: the node's
spans (its run, the engine call) are the span's children.
"""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind, StatusCode

from iop_edge.ports import EdgeRunRecord
from iop_proto import tracing
from iop_proto.tracing import Tracing

PROVIDER_NAME = "iop"
"""``gen_ai.provider.name`` of the edge's span: the client's provider is IOP itself (the
engine behind it is named by the node's engine-call span)."""


def open_span(
    tracer: Tracing, *, operation: str, model: str, stream: bool, received_ms: int
) -> Span:
    """The request's span, begun when the request was received."""
    name = tracing.operation_name(operation)
    return tracer.start(
        f"{name} {model}",
        SpanKind.SERVER,
        start_ns=received_ms * 1_000_000,
        attributes={
            tracing.OPERATION: name,
            tracing.REQUEST_MODEL: model,
            tracing.PROVIDER: PROVIDER_NAME,
            tracing.SYSTEM: PROVIDER_NAME,
            tracing.STREAMING: stream,
        },
    )


def close_span(span: Span, record: EdgeRunRecord) -> None:
    """End ``span`` with what the run log records of the request."""
    attributes: dict[str, str | int | float | bool] = {
        tracing.RUN_ID: record.run_id,
        tracing.RESPONSE_ID: record.run_id,
        "iop.outcome": record.outcome,
        "iop.provider_id": record.provider_id,
        "iop.node_id": record.node_id,
        "iop.attempts": len(record.attempts),
        "iop.queue_wait_ms": record.queue_wait_ms,
        "http.response.status_code": record.status,
    }
    if record.provider_id:
        attributes[tracing.RESPONSE_MODEL] = record.model
    if record.prompt_tokens or record.completion_tokens:
        attributes[tracing.INPUT_TOKENS] = record.prompt_tokens
        attributes[tracing.OUTPUT_TOKENS] = record.completion_tokens
    if record.ttft_ms:
        attributes[tracing.TTFT] = record.ttft_ms / 1000
    span.set_attributes(attributes)
    if record.outcome != "completed":
        span.set_attribute(tracing.ERROR_TYPE, record.error_code or record.outcome)
        span.set_status(StatusCode.ERROR, record.error_code or record.outcome)
    span.end()
