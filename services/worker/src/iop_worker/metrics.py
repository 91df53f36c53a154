"""The worker's Prometheus metrics, in the registry the service runner owns."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

BATCH_OUTCOMES = ("finished", "lost")
LINE_OUTCOMES = ("done", "failed")


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    batches: Counter
    lines: Counter
    lease_renewals: Counter
    leases_lost: Counter
    lines_in_flight: Gauge
    edge_connected: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> WorkerMetrics:
        metrics = cls(
            batches=Counter(
                "iop_worker_batches",
                "Leased batches by outcome: finished (released as finished) or lost "
                "(left to the lease expiry: lease or connection lost, a line unanswered, stopped)",
                ["outcome"],
                registry=registry,
            ),
            lines=Counter(
                "iop_worker_lines",
                "Batch lines by outcome: done (2xx result), failed (other status, or no result)",
                ["outcome"],
                registry=registry,
            ),
            lease_renewals=Counter(
                "iop_worker_lease_renewals",
                "Lease renewals the edge accepted",
                registry=registry,
            ),
            leases_lost=Counter(
                "iop_worker_leases_lost",
                "Leases the edge stopped honouring (batch cancelled, expired or taken over)",
                registry=registry,
            ),
            lines_in_flight=Gauge(
                "iop_worker_lines_in_flight",
                "Batch lines sent to the edge and not answered yet",
                registry=registry,
            ),
            edge_connected=Gauge(
                "iop_worker_edge_connected",
                "Edges the worker is registered with (1 while registered with its one edge)",
                registry=registry,
            ),
        )
        # Every outcome exists from the start, so rates and alerts see a 0, not a gap.
        for outcome in BATCH_OUTCOMES:
            metrics.batches.labels(outcome=outcome)
        for outcome in LINE_OUTCOMES:
            metrics.lines.labels(outcome=outcome)
        return metrics
