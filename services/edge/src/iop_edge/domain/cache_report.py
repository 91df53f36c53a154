"""A provider's prompt cache as its node reports it (docs/ARCHITECTURE.md#cache-affinity).

The node sits beside the engine: it knows which prompts the engine served and how many of
their tokens came from its cache, where the edge only knows what it sent. Selection reads
``held`` before its own guess (``domain.prefix_index``); the catalog shows ``hit_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CacheReport:
    """The last ``CacheState`` of one provider's snapshot, as plain values."""

    held: dict[int, int] = field(default_factory=dict)
    """Prefixes the engine served last: a prefix's last block hash -> its length in blocks
    (``iop_proto.prefix``)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_ms_per_token: float | None = None
    """The engine's recent prefill time per token; ``None`` when it does not say."""

    @property
    def hit_rate(self) -> float | None:
        """Share of prompt tokens served from the cache; ``None`` before any."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
