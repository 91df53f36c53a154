"""One provider at run time: its config, adapter, admission gate and health."""

from __future__ import annotations

from dataclasses import dataclass, field

from iop_node.domain.admission import AdmissionGate
from iop_node.domain.health import Health, HealthTracker
from iop_node.domain.provider import ProviderConfig
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter


@dataclass(eq=False)
class ProviderRuntime:
    """Everything the node knows about one provider; the gate outlives config changes.

    ``adapter`` may be replaced by a config update; runs already executing keep
    the adapter they started with (the executor holds its own reference).
    """

    config: ProviderConfig
    adapter: Adapter
    gate: AdmissionGate
    health: HealthTracker = field(default_factory=HealthTracker)
    retired: bool = False

    def publish(self, metrics: NodeMetrics) -> None:
        """Copy the live counters into the metrics (called on every change)."""
        pid = self.config.id
        metrics.in_flight.labels(pid).set(self.gate.in_flight)
        metrics.queued.labels(pid).set(self.gate.queued)
        metrics.capacity.labels(pid).set(self.gate.capacity)
        for state in Health:
            metrics.health.labels(pid, state.value).set(1 if state is self.health.state else 0)
