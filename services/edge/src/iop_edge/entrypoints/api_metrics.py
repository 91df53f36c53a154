"""The edge API's Prometheus metrics, in the registry the service owns.

Label values are public model ids the catalog knows, or ``""`` when the
request named no known model: a client inventing model names must not be able
to grow the metric series without bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from prometheus_client import CollectorRegistry

from iop_proto.loop_metrics import (
    Counter,
    CounterChild,
    Gauge,
    GaugeChild,
    Histogram,
    HistogramChild,
)

_WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_DURATION_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_OVERHEAD_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10,
)  # fmt: skip


@dataclass(slots=True)
class ModelSeries:
    """One model's series, looked up once: ``labels()`` costs more than the update itself."""

    queue_wait: HistogramChild
    ttft: HistogramChild
    duration: HistogramChild
    in_flight: GaugeChild
    _requests: Counter
    _model: str
    _by_status: dict[int, CounterChild] = field(default_factory=dict)

    def requests(self, status: int) -> CounterChild:
        series = self._by_status.get(status)
        if series is None:
            series = self._by_status[status] = self._requests.labels(self._model, str(status))
        return series


TOKEN_KINDS: Final = ("prompt", "completion", "cached")


@dataclass(frozen=True, slots=True)
class TokenSeries:
    """One model's token counters on one provider, in ``TOKEN_KINDS``' order."""

    prompt: CounterChild
    completion: CounterChild
    cached: CounterChild


@dataclass(frozen=True, slots=True)
class ApiMetrics:
    """Per-model request metrics of ``/v1/chat/completions``, ``/completions``, ``/embeddings``."""

    requests: Counter  # by model and the HTTP status the client got (499: it left)
    queue_wait: Histogram  # edge queue + node queue, for runs that started
    ttft: Histogram  # request received -> first delta
    duration: Histogram  # request received -> last byte (or the error)
    in_flight: Gauge  # requests past validation, not yet answered
    overhead: Histogram  # x-iop-overhead-ms, by operation and stream (see RunTrace.overhead)
    tokens: Counter  # by model, provider and kind: prompt, completion, cached (of prompt)
    _models: dict[str, ModelSeries] = field(default_factory=dict)
    _overheads: dict[tuple[str, bool], HistogramChild] = field(default_factory=dict)
    _tokens: dict[tuple[str, str], TokenSeries] = field(default_factory=dict)

    def overhead_of(self, operation: str, stream: bool) -> HistogramChild:
        """The overhead series of one operation, streamed or not (a bounded label set)."""
        series = self._overheads.get((operation, stream))
        if series is None:
            series = self._overheads[operation, stream] = self.overhead.labels(
                operation, "true" if stream else "false"
            )
        return series

    def tokens_of(self, model: str, provider_id: str) -> TokenSeries:
        """The token counters of ``model`` served by ``provider_id`` (a provider of the
        fleet: the label set stays bounded), looked up once."""
        series = self._tokens.get((model, provider_id))
        if series is None:
            series = self._tokens[model, provider_id] = TokenSeries(
                *(self.tokens.labels(model, provider_id, kind) for kind in TOKEN_KINDS)
            )
        return series

    def model(self, model: str) -> ModelSeries:
        """The series of ``model`` (a catalog id or ``""``: the label set stays bounded)."""
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = ModelSeries(
                queue_wait=self.queue_wait.labels(model),
                ttft=self.ttft.labels(model),
                duration=self.duration.labels(model),
                in_flight=self.in_flight.labels(model),
                _requests=self.requests,
                _model=model,
            )
        return series

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ApiMetrics:
        model = ["model"]
        return cls(
            requests=Counter(
                "iop_edge_requests",
                "Inference requests answered, by model and HTTP status",
                ["model", "status"],
                registry=registry,
            ),
            queue_wait=Histogram(
                "iop_edge_queue_wait_seconds",
                "Time a run waited for a provider (edge queue plus node queue)",
                model,
                buckets=_WAIT_BUCKETS,
                registry=registry,
            ),
            ttft=Histogram(
                "iop_edge_time_to_first_token_seconds",
                "Time from the request to its first delta",
                model,
                buckets=_TTFT_BUCKETS,
                registry=registry,
            ),
            duration=Histogram(
                "iop_edge_request_duration_seconds",
                "Time from the request to its end (success, error or disconnect)",
                model,
                buckets=_DURATION_BUCKETS,
                registry=registry,
            ),
            in_flight=Gauge(
                "iop_edge_requests_in_flight",
                "Inference requests being served (queued or running)",
                model,
                registry=registry,
            ),
            overhead=Histogram(
                "iop_edge_overhead_seconds",
                "Time in the edge and the node, the provider's excluded (x-iop-overhead-ms):"
                ' to the response\'s end, or for streams (stream="true") to its first byte',
                ["operation", "stream"],
                buckets=_OVERHEAD_BUCKETS,
                registry=registry,
            ),
            tokens=Counter(
                "iop_edge_tokens",
                "Tokens of completed runs, by model, provider and kind: prompt, completion,"
                " and cached (the prompt tokens the engine served from its prompt cache)",
                ["model", "provider", "kind"],
                registry=registry,
            ),
        )
