"""What an on-demand provider holds in memory, as its node reports it, and the policy of
warm-aware scheduling (docs/ARCHITECTURE.md#warm-aware-scheduling).

A provider of type Ollama (llama-swap, Lemonade) loads a model at its first request and
unloads it after ``keep_alive`` or to make room: a request sent where its model is not
loaded waits for the load (seconds). Its node reports a ``LoadReport`` in each snapshot;
a provider without one (vLLM, llama.cpp) holds every model it serves, always. Plain data:
the rule that reads it is ``service/warm.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadTime:
    """How long loading one served model took on the provider (its answers' word)."""

    last_ms: int
    mean_ms: int
    loads: int


@dataclass(frozen=True, slots=True)
class LoadReport:
    """``loaded``: served names in memory now, with (since, expires) in Unix ms (0
    unknown); ``timings``: load times by served name; ``max_loaded``: models it holds at
    once (0 unknown: no swapping known)."""

    loaded: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    timings: Mapping[str, LoadTime] = field(default_factory=dict)
    max_loaded: int = 0

    @property
    def swaps(self) -> bool:
        """Full: loading another model unloads one of these."""
        return self.max_loaded > 0 and len(self.loaded) >= self.max_loaded


@dataclass(frozen=True, slots=True)
class WarmPolicy:
    """The edge's ``warm`` settings."""

    enabled: bool = True
    hold_factor: float = 2.0
    """A model's waiters are held for a host that is loading it (or serving it warm)
    this many times its measured load time, before a cold host is loaded as well."""
    assumed_load_s: float = 5.0
    """The load time assumed before any load was measured."""
    max_hold_s: float = 30.0
    """The longest hold, whatever the measured load time."""
    group_grants: int = 8
    """On a host that swaps: the loaded model's waiters take at most this many of its
    freed slots in a row while another model of the host waits."""
    group_wait_s: float = 10.0
    """On a host that swaps: a waiter of a model it does not hold waits at most this
    long for the host to finish the loaded model's work before the host swaps."""
