"""The edge's pool and queue metrics (the HTTP layer has its own, in entrypoints)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE, UNKNOWN, ProviderSlot


@dataclass(frozen=True, slots=True)
class EdgeMetrics:
    queued: Gauge
    provider_in_flight: Gauge
    provider_health: Gauge
    nodes_connected: Gauge
    registrations: Counter
    refusals: Counter
    config_version: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> EdgeMetrics:
        return cls(
            queued=Gauge(
                "iop_edge_model_queued",
                "Requests waiting in a model's queue",
                ["model"],
                registry=registry,
            ),
            provider_in_flight=Gauge(
                "iop_edge_provider_in_flight",
                "Runs in flight on a provider",
                ["provider", "node"],
                registry=registry,
            ),
            provider_health=Gauge(
                "iop_edge_provider_health",
                "1 for the provider's current state (disconnected counts as unavailable)",
                ["provider", "state"],
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
                "Peers refused on the node port, by stage (tls, registration) and reason",
                ["stage", "reason"],
                registry=registry,
            ),
            config_version=Gauge(
                "iop_edge_config_version", "Fleet config version in use", registry=registry
            ),
        )

    def publish_slot(self, slot: ProviderSlot) -> None:
        self.provider_in_flight.labels(slot.provider_id, slot.node_id).set(slot.in_flight)
        state = slot.health if slot.connected else UNAVAILABLE
        for name in (AVAILABLE, UNAVAILABLE, UNKNOWN):
            self.provider_health.labels(slot.provider_id, name).set(1 if name == state else 0)


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
