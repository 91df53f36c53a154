"""The node's Prometheus metrics, per provider, in the registry the runner owns."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Gauge as ClientGauge
from prometheus_client.metrics_core import Metric

from iop_node.domain.admission import AdmissionGate
from iop_proto.loop_metrics import (
    Child,
    Counter,
    Gauge,
    Histogram,
    Labelled,
)

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SERVICE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LoadGauge(Gauge):
    """A provider's load (in flight, queued, capacity) as its admission gate holds it,
    read when the metrics are scraped: the gate is the one count, always current, and
    a run writes no gauge. Providers are watched from ``ProviderRuntime.publish`` on
    (``NodeMetrics.gates``) until ``forget``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        read: Callable[[AdmissionGate], int],
        gates: dict[str, AdmissionGate],
        registry: CollectorRegistry,
    ) -> None:
        self._read = read
        self._gates = gates
        super().__init__(name, documentation, ["provider"], registry=registry)

    def collect(self) -> Iterable[Metric]:
        for provider_id, gate in self._gates.items():
            self.labels(provider_id).set(self._read(gate))
        return super().collect()


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    in_flight: LoadGauge
    queued: LoadGauge
    capacity: LoadGauge
    health: Gauge
    queue_wait: Histogram
    service_time: Histogram
    runs: Counter
    tokens: Counter
    edge_connected: ClientGauge  # not per run: prometheus_client's
    gates: dict[str, AdmissionGate]
    """The admission gates the load gauges read, by provider."""
    # (provider, metric, *other labels) -> the metric's child for them (``child``)
    _children: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def create(cls, registry: CollectorRegistry) -> NodeMetrics:
        provider = ["provider"]
        gates: dict[str, AdmissionGate] = {}
        return cls(
            in_flight=LoadGauge(
                "iop_node_provider_in_flight",
                "Runs executing",
                operator.attrgetter("in_flight"),
                gates,
                registry,
            ),
            queued=LoadGauge(
                "iop_node_provider_queued",
                "Runs waiting for a slot",
                operator.attrgetter("queued"),
                gates,
                registry,
            ),
            capacity=LoadGauge(
                "iop_node_provider_capacity",
                "Configured slots",
                operator.attrgetter("capacity"),
                gates,
                registry,
            ),
            health=Gauge(
                "iop_node_provider_health",
                "1 for the provider's current state, 0 for the others",
                ["provider", "state"],
                registry=registry,
            ),
            queue_wait=Histogram(
                "iop_node_queue_wait_seconds",
                "Time runs spent in the provider's FIFO queue",
                provider,
                buckets=_WAIT_BUCKETS,
                registry=registry,
            ),
            service_time=Histogram(
                "iop_node_service_seconds",
                "Time from a slot being taken to the run's end",
                provider,
                buckets=_SERVICE_BUCKETS,
                registry=registry,
            ),
            runs=Counter(
                "iop_node_runs",
                "Runs ended, by outcome and error code",
                ["provider", "outcome", "code"],
                registry=registry,
            ),
            tokens=Counter(
                "iop_node_tokens",
                "Tokens reported by providers (kind: prompt, completion, and cached: the"
                " prompt tokens served from the engine's prompt cache)",
                ["provider", "kind"],
                registry=registry,
            ),
            edge_connected=ClientGauge(
                "iop_node_edge_connected",
                "Edges the node is registered with (1 while registered with its one edge)",
                registry=registry,
            ),
            gates=gates,
        )

    def child(self, metric: Labelled[Child], provider_id: str, *labels: str) -> Child:
        """``metric.labels(provider_id, *labels)``, looked up once and then kept.

        The children of a provider live as long as its series: ``forget`` drops
        both. A series is still created on first use, so /metrics shows exactly what
        ``labels()`` would.
        """
        key = (provider_id, metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(provider_id, *labels)
        return found

    def forget(self, provider_id: str) -> None:
        """Drop a removed provider's series so a dashboard does not show ghosts."""
        self.gates.pop(provider_id, None)
        for gauge in (self.in_flight, self.queued, self.capacity):
            with contextlib.suppress(KeyError):
                gauge.remove(provider_id)
        # Removed series must not be written through stale children, and the rest are
        # found again by labels() if the provider comes back (or a last run ends).
        for key in [key for key in self._children if key[0] == provider_id]:
            del self._children[key]
