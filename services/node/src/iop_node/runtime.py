"""One provider at run time: its config, adapter, admission gate and health."""

from __future__ import annotations

from dataclasses import dataclass, field

from iop_node.domain.admission import AdmissionGate
from iop_node.domain.cache_account import DEFAULT_CACHE_PREFIXES, CacheAccount
from iop_node.domain.health import Health, HealthTracker
from iop_node.domain.provider import ProviderConfig
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter

_STATES = tuple((state, state.value) for state in Health)


@dataclass(eq=False)
class ProviderRuntime:
    """Everything the node knows about one provider; the gate outlives config changes.

    ``adapter`` may be replaced by a config update; runs already executing keep
    the adapter they started with (the executor holds its own reference). ``cache``
    is what its engine's prompt cache holds, as the node saw it serve.
    """

    config: ProviderConfig
    adapter: Adapter
    gate: AdmissionGate
    health: HealthTracker = field(default_factory=HealthTracker)
    retired: bool = False
    cache: CacheAccount = field(default_factory=lambda: CacheAccount(DEFAULT_CACHE_PREFIXES))

    def publish(self, metrics: NodeMetrics) -> None:
        """Show the provider in the metrics: its load (read from the gate at every
        scrape) and its health (copied here, on every change of it)."""
        pid, current = self.config.id, self.health.state
        metrics.gates[pid] = self.gate
        for state, name in _STATES:
            metrics.child(metrics.health, pid, name).set(1 if state is current else 0)
