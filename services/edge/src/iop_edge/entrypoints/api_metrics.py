"""The edge API's Prometheus metrics, in the registry the service owns.

Label values are public model ids the catalog knows, or ``""`` when the
request named no known model: a client inventing model names must not be able
to grow the metric series without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

from prometheus_client import CollectorRegistry

from iop_edge.ports import EdgeRunRecord
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


K = TypeVar("K")
V = TypeVar("V")


class SeriesCache(dict[K, V]):
    """Children of a labelled metric by their labels, each made by ``make`` when first
    asked for: a bounded label set (catalog models, fleet providers, a few operations)
    whose children live as long as the metric."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[K], V]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: K) -> V:
        value = self[key] = self._make(key)
        return value


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """One model's series."""

    queue_wait: HistogramChild
    ttft: HistogramChild
    duration: HistogramChild
    in_flight: GaugeChild


TOKEN_KINDS: Final = ("prompt", "completion", "cached")


@dataclass(frozen=True, slots=True)
class TokenSeries:
    """One model's token counters on one provider, in ``TOKEN_KINDS``' order."""

    prompt: CounterChild
    completion: CounterChild
    cached: CounterChild


RequestLabels = tuple[str, int, str, str, str]  # model, status, provider, key, api
TokenLabels = tuple[str, str, str, str]  # model, provider, key, api


@dataclass(frozen=True, slots=True)
class ApiMetrics:
    """Per-model request metrics of every inference API, and of batch lines.

    ``models``, ``overheads``, ``requests_by`` and ``tokens_by`` hold the series a
    request updates, by their labels: ``models[model]`` (a catalog id or ``""``),
    ``overheads[operation, stream]``, ``requests_by[model, status, provider, key, api]``
    and ``tokens_by[model, provider, key, api]``, so every label set stays bounded:
    models and providers are the fleet's, ``api`` one of ``domain.usage.Api``, and
    ``key`` a key id of the fleet, set only once the caller authenticated (``""`` before,
    and while the API is open): a client cannot add a series by inventing a key.
    Keys are issued by an operator, a few to a few hundred, each using a few models and
    APIs, so the product stays in the thousands of series at the worst.
    """

    requests: Counter  # by model, HTTP status the client got (499: it left), provider, key, api
    queue_wait: Histogram  # edge queue + node queue, for runs that started
    ttft: Histogram  # request received -> first delta
    duration: Histogram  # request received -> last byte (or the error)
    in_flight: Gauge  # requests past validation, not yet answered
    overhead: Histogram  # x-iop-overhead-ms, by operation and stream (see RunTrace.overhead)
    tokens: Counter  # by model, provider, kind (prompt, completion, cached), key and api
    models: SeriesCache[str, ModelSeries] = field(init=False)
    overheads: SeriesCache[tuple[str, bool], HistogramChild] = field(init=False)
    requests_by: SeriesCache[RequestLabels, CounterChild] = field(init=False)
    tokens_by: SeriesCache[TokenLabels, TokenSeries] = field(init=False)

    def __post_init__(self) -> None:
        # frozen: the caches are made once, here, each reading this object's metrics
        object.__setattr__(self, "models", SeriesCache(self._model_series))
        object.__setattr__(self, "overheads", SeriesCache(self._overhead_series))
        object.__setattr__(self, "tokens_by", SeriesCache(self._token_series))
        object.__setattr__(self, "requests_by", SeriesCache(self._request_series))

    def count(self, record: EdgeRunRecord) -> None:
        """One ended run, an HTTP request's or a batch line's, in the request and token
        counters, under the labels its record gives (tokens: completed runs only)."""
        model, provider, key, api = record.model, record.provider_id, record.key_id, record.api
        self.requests_by[model, record.status, provider, key, api].inc()
        if record.outcome == "completed" and provider:
            tokens = self.tokens_by[model, provider, key, api]
            tokens.prompt.inc(record.prompt_tokens)
            tokens.completion.inc(record.completion_tokens)
            tokens.cached.inc(record.cached_tokens)

    def _model_series(self, model: str) -> ModelSeries:
        return ModelSeries(
            queue_wait=self.queue_wait.labels(model),
            ttft=self.ttft.labels(model),
            duration=self.duration.labels(model),
            in_flight=self.in_flight.labels(model),
        )

    def _request_series(self, labels: RequestLabels) -> CounterChild:
        model, status, provider, key, api = labels
        return self.requests.labels(model, str(status), provider, key, api)

    def _overhead_series(self, labels: tuple[str, bool]) -> HistogramChild:
        operation, stream = labels
        return self.overhead.labels(operation, "true" if stream else "false")

    def _token_series(self, labels: TokenLabels) -> TokenSeries:
        model, provider_id, key, api = labels
        return TokenSeries(
            *(self.tokens.labels(model, provider_id, kind, key, api) for kind in TOKEN_KINDS)
        )

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ApiMetrics:
        model = ["model"]
        return cls(
            requests=Counter(
                "iop_edge_requests",
                "Inference requests answered (batch lines too), by model, HTTP status, the"
                ' provider that served it ("" if none did), the API key\'s id ("" if none)'
                " and the API (chat_completions, completions, embeddings, responses,"
                " messages, batch)",
                ["model", "status", "provider", "key", "api"],
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
                " and cached (the prompt tokens the engine served from its prompt cache);"
                " and by the API key's id and the API, as iop_edge_requests",
                ["model", "provider", "kind", "key", "api"],
                registry=registry,
            ),
        )
