"""The node's spans of one run (docs/ARCHITECTURE.md#traces): its run, and the engine call.

Made only for a run the edge traced (``ExecutionSpec.traceparent``) on a node whose
tracing is on; both are made once the run has ended, with the times it noted as it
went (the span API takes them), so a run's path holds no span object and a node with
tracing off makes none. The run's span is the edge span's child; the engine call's,
the run span's, with the GenAI attributes of the call (the served model, the engine's
type, the tokens, the time to its first token).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import Span, SpanKind, StatusCode

from iop_node.domain.runs import ExecutionSpec, Usage
from iop_proto import tracing
from iop_proto.tracing import Tracing


@dataclass(frozen=True, slots=True)
class RunTimes:
    """When a run's parts happened, Unix ns (0: did not happen)."""

    received_ns: int
    engine_began_ns: int  # the adapter was called (a slot taken)
    first_token_ms: int  # Unix ms the first token went to the edge (0: none)
    ended_ns: int


def record_run_spans(
    tracer: Tracing,
    spec: ExecutionSpec,
    node_id: str,
    times: RunTimes,
    *,
    outcome: str,
    code: str,
    usage: Usage | None,
) -> None:
    """The run's span and, when the engine was called, the engine call's, both ended."""
    name = tracing.operation_name(spec.operation.value)
    run = tracer.start(
        f"node {name} {spec.target}",
        SpanKind.SERVER,
        traceparent=spec.traceparent,
        start_ns=times.received_ns,
        attributes={
            tracing.RUN_ID: spec.run_id,
            tracing.OPERATION: name,
            tracing.REQUEST_MODEL: spec.target,
            "iop.node_id": node_id,
            "iop.provider_id": spec.provider_id,
            "iop.outcome": outcome,
        },
    )
    if times.engine_began_ns:
        attributes: dict[str, str | int | float | bool] = {
            tracing.OPERATION: name,
            tracing.REQUEST_MODEL: spec.target,
            tracing.PROVIDER: spec.adapter,
            tracing.SYSTEM: spec.adapter,
            tracing.STREAMING: spec.stream,
            tracing.RUN_ID: spec.run_id,
        }
        if outcome == "completed":
            attributes[tracing.RESPONSE_MODEL] = spec.target
        if usage is not None:
            attributes[tracing.INPUT_TOKENS] = usage.prompt_tokens
            attributes[tracing.OUTPUT_TOKENS] = usage.completion_tokens
        engine = tracer.start(
            f"{name} {spec.target}",
            SpanKind.CLIENT,
            parent=run,
            start_ns=times.engine_began_ns,
            attributes=attributes,
        )
        if times.first_token_ms:
            first_ns = times.first_token_ms * 1_000_000
            ttft_s = max(first_ns - times.engine_began_ns, 0) / 1e9
            engine.set_attribute(tracing.TTFT, ttft_s)
            engine.add_event("gen_ai.first_token", timestamp=first_ns)
        _end(engine, outcome, code, times.ended_ns)
    _end(run, outcome, code, times.ended_ns)


def _end(span: Span, outcome: str, code: str, ended_ns: int) -> None:
    if outcome != "completed":
        span.set_attribute(tracing.ERROR_TYPE, code or outcome)
        span.set_status(StatusCode.ERROR, code or outcome)
    span.end(end_time=ended_ns)
