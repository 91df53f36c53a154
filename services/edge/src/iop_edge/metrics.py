"""The edge's pool and queue metrics (the HTTP layer has its own, in entrypoints)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from iop_edge.domain.outliers import Phase
from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE, UNKNOWN, ProviderSlot
from iop_proto import loop_metrics

_HEALTH_STATES = (AVAILABLE, UNAVAILABLE, UNKNOWN)


@dataclass(slots=True)
class _ProviderSeries:
    """A provider's gauge children and the values last set on them."""

    node_id: str
    in_flight: loop_metrics.GaugeChild
    health: tuple[loop_metrics.GaugeChild, ...]  # one per ``_HEALTH_STATES``
    ejected: Gauge
    last_in_flight: int = -1
    last_state: str = ""


@dataclass(slots=True)
class _QueueSeries:
    gauge: loop_metrics.GaugeChild
    last: int = -1


@dataclass(frozen=True, slots=True)
class EdgeMetrics:
    """The edge's gauges and counters.

    The dispatcher publishes a provider or a queue on every change, i.e. several
    times per request: the labelled children are looked up once and kept (until
    the provider or model leaves the fleet), and only values that moved are set.
    Those three are ``loop_metrics`` gauges (an update is one call, no lock).
    """

    queued: loop_metrics.Gauge
    provider_in_flight: loop_metrics.Gauge
    provider_health: loop_metrics.Gauge
    provider_ejected: Gauge
    ejections: Counter
    nodes_connected: Gauge
    registrations: Counter
    refusals: Counter
    config_version: Gauge
    control_plane_connected: Gauge
    retries: Counter  # by model and the provider that failed (docs/ARCHITECTURE.md#failover)
    affinity: Counter  # by model and decision (docs/ARCHITECTURE.md#cache-affinity)
    _providers: dict[str, _ProviderSeries] = field(default_factory=dict, init=False)
    _queues: dict[str, _QueueSeries] = field(default_factory=dict, init=False)
    _retried: set[tuple[str, str]] = field(default_factory=set, init=False)  # retries' labels
    _affine: set[tuple[str, str]] = field(default_factory=set, init=False)  # affinity's labels

    @classmethod
    def create(cls, registry: CollectorRegistry) -> EdgeMetrics:
        return cls(
            queued=loop_metrics.Gauge(
                "iop_edge_model_queued",
                "Requests waiting in a model's queue",
                ["model"],
                registry=registry,
            ),
            provider_in_flight=loop_metrics.Gauge(
                "iop_edge_provider_in_flight",
                "Runs in flight on a provider",
                ["provider", "node"],
                registry=registry,
            ),
            provider_health=loop_metrics.Gauge(
                "iop_edge_provider_health",
                "1 for the provider's current state (disconnected counts as unavailable)",
                ["provider", "state"],
                registry=registry,
            ),
            provider_ejected=Gauge(
                "iop_edge_provider_ejected",
                "1 while the provider is ejected from selection for failing run after run"
                " (outlier ejection; 0 in selection or on trial)",
                ["provider"],
                registry=registry,
            ),
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
                " (sent to the provider holding it), waited (got it after a wait), wait_expired"
                " (the wait ran out: the seed's rule chose)",
                ["model", "decision"],
                registry=registry,
            ),
        )

    def count_retry(self, model_id: str, failed_provider_id: str) -> None:
        """A run of ``model_id`` failed on ``failed_provider_id`` and is tried elsewhere."""
        self._retried.add((model_id, failed_provider_id))
        self.retries.labels(model_id, failed_provider_id).inc()

    def count_affinity(self, model_id: str, decision: str) -> None:
        """Cache affinity decided a request of ``model_id`` (``decision``: see above)."""
        self._affine.add((model_id, decision))
        self.affinity.labels(model_id, decision).inc()

    def publish_slot(self, slot: ProviderSlot) -> None:
        series = self._providers.get(slot.provider_id)
        if series is None or series.node_id != slot.node_id:
            series = self._track_provider(slot.provider_id, slot.node_id)
        own, reported = slot.own_in_flight, slot.reported_in_flight
        in_flight = own if own > reported else reported
        if in_flight != series.last_in_flight:
            series.last_in_flight = in_flight
            series.in_flight.set(in_flight)
        state = slot.health if slot.connected else UNAVAILABLE
        if state != series.last_state:
            series.last_state = state
            for name, child in zip(_HEALTH_STATES, series.health, strict=True):
                child.set(1 if name == state else 0)

    def publish_outlier(self, slot: ProviderSlot) -> None:
        """The provider's outlier state changed (each change once: entering ``EJECTED``
        is one ejection)."""
        series = self._providers.get(slot.provider_id)
        if series is None or series.node_id != slot.node_id:
            series = self._track_provider(slot.provider_id, slot.node_id)
        ejected = slot.outlier.phase is Phase.EJECTED
        series.ejected.set(1 if ejected else 0)
        if ejected:
            self.ejections.labels(slot.provider_id).inc()

    def publish_queued(self, model_id: str, waiting: int) -> None:
        series = self._queues.get(model_id)
        if series is None:
            series = self._queues[model_id] = _QueueSeries(self.queued.labels(model_id))
        if waiting != series.last:
            series.last = waiting
            series.gauge.set(waiting)

    def forget_provider(self, provider_id: str) -> None:
        """The provider left the fleet: its series go from the registry."""
        series = self._providers.pop(provider_id, None)
        if series is not None:
            self.provider_in_flight.remove(provider_id, series.node_id)
            for name in _HEALTH_STATES:
                self.provider_health.remove(provider_id, name)
            self.provider_ejected.remove(provider_id)
            self.ejections.remove(provider_id)
        self._forget_retries(lambda labels: labels[1] == provider_id)

    def forget_model(self, model_id: str) -> None:
        """The model left the fleet: its queue gauge goes from the registry."""
        if self._queues.pop(model_id, None) is not None:
            self.queued.remove(model_id)
        self._forget_retries(lambda labels: labels[0] == model_id)
        for labels in [labels for labels in self._affine if labels[0] == model_id]:
            self._affine.discard(labels)
            self.affinity.remove(*labels)

    def _forget_retries(self, gone: Callable[[tuple[str, str]], bool]) -> None:
        for labels in [labels for labels in self._retried if gone(labels)]:
            self._retried.discard(labels)
            self.retries.remove(*labels)

    def _track_provider(self, provider_id: str, node_id: str) -> _ProviderSeries:
        old = self._providers.get(provider_id)
        if old is not None:  # moved to another node: the old node's series goes
            self.provider_in_flight.remove(provider_id, old.node_id)
        series = self._providers[provider_id] = _ProviderSeries(
            node_id,
            self.provider_in_flight.labels(provider_id, node_id),
            tuple(self.provider_health.labels(provider_id, name) for name in _HEALTH_STATES),
            self.provider_ejected.labels(provider_id),
        )
        if old is None:
            self.ejections.labels(provider_id)  # a 0 series from the start, for rate()
        return series


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
