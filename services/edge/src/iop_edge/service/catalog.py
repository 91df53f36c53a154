"""The read-only provider and model catalog (docs/ARCHITECTURE.md#catalog).

A view only: nothing here changes routing. The catalog reads the registry's live
pool through ``ProviderView`` (the API key ring is the fleet's: ``FleetHolder``).

A restricted key (one with a model list) sees the catalog through that list:
only the models it may use, only the providers serving one of them, and of
each such provider only those models: what it may not use, it cannot probe.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard

from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.controls import ControlEntry, provider_control_view
from iop_edge.domain.fleet import (
    PUBLIC_OPERATIONS,
    ApiKeyEntry,
    ModelEntry,
    Operation,
    ProviderEntry,
)
from iop_edge.domain.outliers import Phase
from iop_edge.domain.pool import LIFECYCLE_FLAGS, UNAVAILABLE
from iop_edge.ports import FleetView, OutlierView, ProviderView, QueueView, SlotView
from iop_edge.service.warm_catalog import warm_provider_ids, warmth_fields


class PoolCatalog:
    """Implements ``Catalog`` over the fleet, the live pool and the queues (read only)."""

    def __init__(self, fleet: FleetView, providers: ProviderView, queues: QueueView) -> None:
        self._fleet = fleet
        self._providers = providers
        self._queues = queues

    def models(self) -> list[ModelEntry]:
        return list(self._fleet.current.models.values())

    def model(self, model_id: str) -> ModelEntry | None:
        return self._fleet.current.models.get(model_id)

    def provider_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        fleet = self._fleet.current
        views = []
        for slot in self._providers.slots():
            entry = fleet.providers.get(slot.provider_id)
            serves = fleet.models_of_provider(slot.provider_id)
            if _restricted(key):
                serves = [m for m in serves if key.allows(m)]
                if not serves:
                    continue
                # the provider's own names of the allowed models, nothing else it holds
                names = dict.fromkeys(fleet.models[m].providers[slot.provider_id] for m in serves)
                models = list(names)
            else:
                models = list(slot.models or (entry.models if entry else ()))
            views.append(
                {
                    "provider_id": slot.provider_id,
                    "node_id": slot.node_id,
                    "type": slot.type,
                    "category": slot.category,
                    "health": slot.health if slot.connected else UNAVAILABLE,
                    "connected": slot.connected,
                    "capacity": slot.capacity,
                    "in_flight": slot.in_flight,
                    "load_ratio": round(slot.load_ratio, 4),
                    "queued": slot.node_queued,
                    "models": models,
                    "serves": serves,
                    "lifecycle_capabilities": {
                        flag: slot.lifecycle.get(flag, False) for flag in LIFECYCLE_FLAGS
                    },
                    "operations": _in_order(slot.operations),
                    # answered 501 for these: not chosen for them until its node reconnects
                    "refused_operations": _in_order(slot.refused),
                    "detail": slot.detail,
                    **_outlier_fields(slot.outlier),
                    "cache": _cache_fields(slot.cache),
                    "control": _control_fields(entry, slot, fleet.controls),
                    "engine": dict(slot.engine) or None,  # None until its node said
                    "warmth": warmth_fields(slot.warmth, models),
                }
            )
        return views

    def model_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        scope = key if _restricted(key) else None
        return [
            self._model_view(model)
            for model in self._fleet.current.models.values()
            if scope is None or scope.allows(model.id)
        ]

    def _model_view(self, model: ModelEntry) -> dict[str, Any]:
        slots = [slot for p in model.providers if (slot := self._providers.slot(p))]
        usable = [slot.provider_id for slot in slots if slot.usable]
        return {
            "id": model.id,
            "display_name": model.display_name,
            "providers": dict(model.providers),
            "available_providers": usable,
            # false with the reason: no provider at all (its nodes retired, say) is for the
            # fleet file to fix; providers that are all down, for their nodes
            "available": bool(usable),
            "unavailable_reason": None if usable else _unavailable(model),
            # what some provider of it offers: any other is refused with a 400
            "operations": _in_order(frozenset().union(*(slot.operations for slot in slots))),
            "queued": self._queues.queued(model.id),
            "preference": list(model.preference),  # an operator's order (runtime control)
            # the usable providers holding it in memory now (all, for always-loaded ones)
            "warm_providers": warm_provider_ids(
                (s.provider_id, model.providers[s.provider_id], s.warmth, s.usable) for s in slots
            ),
        }

    def any_available(self) -> bool:
        return any(slot.usable for slot in self._providers.slots())

    def offers(self, model_id: str, operation: Operation) -> bool:
        model = self._fleet.current.models.get(model_id)
        if model is None:
            return False
        slots = (self._providers.slot(p) for p in model.providers)
        return any(s is not None and s.usable and operation in s.operations for s in slots)


def _unavailable(model: ModelEntry) -> str:
    if not model.providers:
        return "no provider serves it: give it one in the fleet file, or drop it there"
    return f"none of its {len(model.providers)} provider(s) is available now"


def _in_order(operations: frozenset[Operation]) -> list[str]:
    return [operation.value for operation in PUBLIC_OPERATIONS if operation in operations]


def _outlier_fields(outlier: OutlierView) -> dict[str, Any]:
    """Why a provider the node calls available may still be out of selection: the edge
    ejected it (``health`` stays the node's word)."""
    ejected = outlier.phase is Phase.EJECTED
    return {
        "outlier_state": outlier.phase.value,
        "ejected": ejected,
        "ejected_until_ms": round(outlier.until * 1000) if ejected else None,
        "consecutive_failures": outlier.consecutive_failures,
    }


def _cache_fields(cache: CacheReport) -> dict[str, Any]:
    """How much of the provider's prompts its engine served from its prompt cache, by its
    node's last snapshot (docs/ARCHITECTURE.md#cache-affinity); ``hit_rate`` null before
    it reported any prompt."""
    rate = cache.hit_rate
    return {
        "hit_rate": None if rate is None else round(rate, 4),
        "prompt_tokens": cache.prompt_tokens,
        "cached_tokens": cache.cached_tokens,
    }


def _control_fields(
    entry: ProviderEntry | None, slot: SlotView, controls: Iterable[ControlEntry]
) -> dict[str, Any]:
    """Its runtime control (docs/ARCHITECTURE.md#runtime-control): state, override, who
    set what and when."""
    state, declared, held = (
        (entry.control_state, entry.declared_capacity, entry.held_capacity) if entry else ("", 0, 0)
    )
    return provider_control_view(
        slot.node_id, slot.provider_id, state, declared, slot.in_flight, controls, held
    )


def _restricted(key: ApiKeyEntry | None) -> TypeGuard[ApiKeyEntry]:
    """The catalog is filtered for this key: it has a model list and is not an operator's."""
    return key is not None and bool(key.models) and not key.operator
