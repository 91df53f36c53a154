"""OpenTelemetry traces of the inference path, exported over OTLP (HTTP/protobuf).

Off by default: a service whose ``tracing.otlp_endpoint`` is empty gets no ``Tracing``
(``open_tracing`` returns ``None``), loads no SDK or exporter and makes no span; its
request path pays one ``is None`` test. On, every span goes through the SDK's batch
processor: the request path only queues it, a background thread exports.

The edge's span of a request travels to the node as a W3C ``traceparent`` in the run
request (``RunRequest.traceparent``): the node's spans join the edge's trace. Attribute
names follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

from pydantic import Field

from iop_proto.service.settings import FrozenModel

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, Tracer

# The GenAI semantic conventions' attribute names (opentelemetry semconv, gen_ai.*).
OPERATION: Final = "gen_ai.operation.name"
REQUEST_MODEL: Final = "gen_ai.request.model"
RESPONSE_MODEL: Final = "gen_ai.response.model"
PROVIDER: Final = "gen_ai.provider.name"
SYSTEM: Final = "gen_ai.system"  # the older name of gen_ai.provider.name, still read widely
INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
TTFT: Final = "gen_ai.server.time_to_first_token"  # seconds, as the semconv metric's unit
RESPONSE_ID: Final = "gen_ai.response.id"
STREAMING: Final = "gen_ai.request.stream"
RUN_ID: Final = "iop.run_id"
ERROR_TYPE: Final = "error.type"

_OPERATION_NAMES: Final = {
    "chat_completions": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}


def operation_name(operation: str) -> str:
    """IOP's operation (``chat_completions`` ...) as ``gen_ai.operation.name``; one the
    conventions do not name (``count_tokens``) keeps its own name."""
    return _OPERATION_NAMES.get(operation, operation)


class TracingSettings(FrozenModel):
    """``tracing:`` in a service's file: where spans go; no endpoint, no spans."""

    otlp_endpoint: str = Field(
        default="",
        description=(
            "OTLP/HTTP traces URL (e.g. http://127.0.0.1:4318/v1/traces, or a Phoenix"
            " server's http://host:6006/v1/traces); empty: tracing off, no span is made"
        ),
    )
    service_name: str = Field(
        default="", description="resource service.name; empty: the service id"
    )
    export_timeout_s: float = Field(default=10.0, gt=0, description="one export's deadline")


class Tracing:
    """A service's tracer and the provider that owns its exporter; ``close`` flushes."""

    def __init__(self, provider: TracerProvider, tracer: Tracer) -> None:
        self._provider = provider
        self.tracer = tracer

    def start(
        self,
        name: str,
        kind: SpanKind,
        *,
        traceparent: str = "",
        parent: Span | None = None,
        start_ns: int | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Span:
        """A span begun at ``start_ns`` (Unix ns; now if ``None``), the child of ``parent``
        or of the remote span ``traceparent`` names, else the root of a new trace."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = None
        if parent is not None:
            context = trace.set_span_in_context(parent)
        elif traceparent:
            context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        return self.tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=start_ns
        )

    async def close(self) -> None:
        """Export what is queued and stop the exporter (off the loop: it blocks on HTTP)."""
        await asyncio.to_thread(self._provider.shutdown)


def open_tracing(settings: TracingSettings, service_id: str) -> Tracing | None:
    """The service's ``Tracing``, or ``None`` when no endpoint is set (tracing off)."""
    if not settings.otlp_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": settings.service_name or service_id})
    # A provider of its own, never the global one: two services in one process (the
    # tests) keep apart, and nothing else in the process starts tracing by accident.
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_s)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, provider.get_tracer("iop"))


def traceparent(span: Span) -> str:
    """``span`` as a W3C traceparent header value."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id(span: Span) -> str:
    """``span``'s trace id, 32 hex digits (what a receiver shows and the run log keeps)."""
    return f"{span.get_span_context().trace_id:032x}"
