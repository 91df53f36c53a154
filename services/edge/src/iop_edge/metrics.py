"""The edge's pool and queue metrics (the HTTP layer has its own, in entrypoints)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from iop_edge.domain.outliers import Phase
from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE, UNKNOWN, ProviderSlot

_HEALTH_STATES = (AVAILABLE, UNAVAILABLE, UNKNOWN)


class _PoolCollector(Collector):
    """The pool's gauges, read from the slots and the queues when Prometheus scrapes.

    The pool keeps these values already (a slot's in-flight counts, health and outlier
    phase; a queue's length), and they change several times per request: read at scrape
    time, they are never out of step with the pool, and a provider or a model that left
    the fleet leaves the metrics with it (what the registry and the dispatcher hold is
    what is shown)."""

    def __init__(self) -> None:
        self.slots: Callable[[], Iterable[ProviderSlot]] = tuple
        self.queues: Callable[[], Iterable[tuple[str, int]]] = tuple

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        queued, in_flight, health, ejected = families = self._families()
        for model_id, waiting in self.queues():
            queued.add_metric((model_id,), waiting)
        for slot in self.slots():
            provider_id = slot.provider_id
            in_flight.add_metric((provider_id, slot.node_id), slot.in_flight)
            state = slot.health if slot.connected else UNAVAILABLE
            for name in _HEALTH_STATES:
                health.add_metric((provider_id, name), 1 if name == state else 0)
            ejected.add_metric((provider_id,), 1 if slot.outlier.phase is Phase.EJECTED else 0)
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "iop_edge_model_queued", "Requests waiting in a model's queue", labels=["model"]
            ),
            GaugeMetricFamily(
                "iop_edge_provider_in_flight",
                "Runs in flight on a provider",
                labels=["provider", "node"],
            ),
            GaugeMetricFamily(
                "iop_edge_provider_health",
                "1 for the provider's current state (disconnected counts as unavailable)",
                labels=["provider", "state"],
            ),
            GaugeMetricFamily(
                "iop_edge_provider_ejected",
                "1 while the provider is ejected from selection for failing run after run"
                " (outlier ejection; 0 in selection or on trial)",
                labels=["provider"],
            ),
        ]


@dataclass(frozen=True, slots=True)
class EdgeMetrics:
    """The edge's gauges and counters.

    The pool's gauges (queued, in flight, health, ejected) are read from the registry's
    slots and the dispatcher's queues at scrape time (``watch_slots``, ``watch_queues``);
    the counters count events as they happen.
    """

    ejections: Counter
    nodes_connected: Gauge
    registrations: Counter
    refusals: Counter
    config_version: Gauge
    control_plane_connected: Gauge
    retries: Counter  # by model and the provider that failed (docs/ARCHITECTURE.md#failover)
    affinity: Counter  # by model and decision (docs/ARCHITECTURE.md#cache-affinity)
    preemptions: Counter  # batch lines' runs ended for interactive requests, by model
    _pool: _PoolCollector = field(default_factory=_PoolCollector, init=False)
    _providers: set[str] = field(default_factory=set, init=False)  # ejections' labels
    _retried: set[tuple[str, str]] = field(default_factory=set, init=False)  # retries' labels
    _affine: set[tuple[str, str]] = field(default_factory=set, init=False)  # affinity's labels
    _preempted: set[str] = field(default_factory=set, init=False)  # preemptions' models

    @classmethod
    def create(cls, registry: CollectorRegistry) -> EdgeMetrics:
        metrics = cls(
            ejections=Counter(
                "iop_edge_ejections",
                "Outlier ejections of a provider from selection",
                ["provider"],
                registry=registry,
            ),
            nodes_connected=Gauge(
                "iop_edge_nodes_connected", "Registered node connections", registry=registry
            ),
            registrations=Counter(
                "iop_edge_node_registrations",
                "Node registrations by result",
                ["result"],
                registry=registry,
            ),
            refusals=Counter(
                "iop_edge_peer_refusals",
                "Peers refused on the node port, by stage (tls, registration, ownership), "
                "role (node, worker; unknown before registration) and reason",
                ["stage", "role", "reason"],
                registry=registry,
            ),
            config_version=Gauge(
                "iop_edge_config_version", "Fleet config version in use", registry=registry
            ),
            control_plane_connected=Gauge(
                "iop_edge_control_plane_connected",
                "1 while the edge holds a live control-plane connection (0: serving from cache,"
                " registrations refused)",
                registry=registry,
            ),
            retries=Counter(
                "iop_edge_retries",
                "Runs opened again on another provider after failing before their first byte,"
                " by model and by the provider that failed",
                ["model", "provider"],
                registry=registry,
            ),
            affinity=Counter(
                "iop_edge_affinity_decisions",
                "Requests steered by cache affinity, by model and decision: session or prefix"
                " (sent to the provider holding it), rendezvous (a new session's provider, the"
                " same on every edge), waited (got it after a wait), wait_expired (the wait ran"
                " out: the seed's rule chose)",
                ["model", "decision"],
                registry=registry,
            ),
            preemptions=Counter(
                "iop_edge_batch_preemptions",
                "Batch lines' runs ended to give their slot to an interactive request (the"
                " line runs again), by model (docs/ARCHITECTURE.md#fair-queueing)",
                ["model"],
                registry=registry,
            ),
        )
        registry.register(metrics._pool)
        return metrics

    def watch_slots(self, slots: Callable[[], Iterable[ProviderSlot]]) -> None:
        """The pool's gauges of providers read ``slots()`` (the registry's) at each scrape."""
        self._pool.slots = slots

    def watch_queues(self, queues: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """``iop_edge_model_queued`` reads ``queues()`` (model id, waiting) at each scrape."""
        self._pool.queues = queues

    def count_retry(self, model_id: str, failed_provider_id: str) -> None:
        """A run of ``model_id`` failed on ``failed_provider_id`` and is tried elsewhere."""
        self._retried.add((model_id, failed_provider_id))
        self.retries.labels(model_id, failed_provider_id).inc()

    def count_affinity(self, model_id: str, decision: str) -> None:
        """Cache affinity decided a request of ``model_id`` (``decision``: see above)."""
        self._affine.add((model_id, decision))
        self.affinity.labels(model_id, decision).inc()

    def count_preemption(self, model_id: str) -> None:
        """A batch line of ``model_id`` yielded its slot to an interactive request."""
        self._preempted.add(model_id)
        self.preemptions.labels(model_id).inc()

    def track_provider(self, provider_id: str) -> None:
        """The provider joined the fleet: its ejection counter starts at 0, for rate()."""
        if provider_id not in self._providers:
            self._providers.add(provider_id)
            self.ejections.labels(provider_id)

    def count_ejection(self, slot: ProviderSlot) -> None:
        """The provider was ejected (each ejection once)."""
        self.track_provider(slot.provider_id)
        self.ejections.labels(slot.provider_id).inc()

    def forget_provider(self, provider_id: str) -> None:
        """The provider left the fleet: its series go from the registry."""
        if provider_id in self._providers:
            self._providers.discard(provider_id)
            self.ejections.remove(provider_id)
        self._forget_retries(lambda labels: labels[1] == provider_id)

    def forget_model(self, model_id: str) -> None:
        """The model left the fleet: its counters' series go from the registry."""
        self._forget_retries(lambda labels: labels[0] == model_id)
        if model_id in self._preempted:
            self._preempted.discard(model_id)
            self.preemptions.remove(model_id)
        for labels in [labels for labels in self._affine if labels[0] == model_id]:
            self._affine.discard(labels)
            self.affinity.remove(*labels)

    def _forget_retries(self, gone: Callable[[tuple[str, str]], bool]) -> None:
        for labels in [labels for labels in self._retried if gone(labels)]:
            self._retried.discard(labels)
            self.retries.remove(*labels)


@dataclass(frozen=True, slots=True)
class BatchMetrics:
    """Batch jobs (OpenAI Batch API): statuses, line outcomes, worker leases."""

    batches: Gauge  # by status
    lines: Counter  # finished lines by outcome: done | failed
    lease_renewals: Counter
    lease_expiries: Counter  # leases found expired (their worker went quiet)

    @classmethod
    def create(cls, registry: CollectorRegistry) -> BatchMetrics:
        return cls(
            batches=Gauge("iop_edge_batches", "Batches by status", ["status"], registry=registry),
            lines=Counter(
                "iop_edge_batch_lines",
                "Batch lines finished, by outcome (done, failed)",
                ["outcome"],
                registry=registry,
            ),
            lease_renewals=Counter(
                "iop_edge_batch_lease_renewals", "Batch lease renewals", registry=registry
            ),
            lease_expiries=Counter(
                "iop_edge_batch_lease_expiries",
                "Batch leases that expired without renewal or release",
                registry=registry,
            ),
        )
