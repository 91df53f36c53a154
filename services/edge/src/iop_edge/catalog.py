"""The read-only provider and model catalog (seed S06-S08, D06) and the API key ring.

Views only: nothing here changes routing. The catalog reads the dispatcher's
live pool; the key ring reads the fleet's key policies (hashes only).
"""

from __future__ import annotations

import hashlib
from typing import Any

from iop_edge.dispatch import Dispatcher
from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry
from iop_edge.domain.pool import LIFECYCLE_FLAGS, UNAVAILABLE


class PoolCatalog:
    """Implements ``Catalog`` over the dispatcher's state."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    def models(self) -> list[ModelEntry]:
        return list(self._dispatcher.fleet.models.values())

    def model(self, model_id: str) -> ModelEntry | None:
        return self._dispatcher.fleet.models.get(model_id)

    def provider_views(self) -> list[dict[str, Any]]:
        fleet = self._dispatcher.fleet
        views = []
        for slot in self._dispatcher.slots.values():
            entry = fleet.providers.get(slot.provider_id)
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
                    "models": list(slot.models or (entry.models if entry else ())),
                    "serves": fleet.models_of_provider(slot.provider_id),
                    "lifecycle_capabilities": {
                        flag: slot.lifecycle.get(flag, False) for flag in LIFECYCLE_FLAGS
                    },
                    "detail": slot.detail,
                }
            )
        return views

    def model_views(self) -> list[dict[str, Any]]:
        slots = self._dispatcher.slots
        return [
            {
                "id": model.id,
                "display_name": model.display_name,
                "providers": dict(model.providers),
                "available_providers": [
                    p for p in model.providers if p in slots and slots[p].usable
                ],
                "queued": self._dispatcher.queued(model.id),
            }
            for model in self._dispatcher.fleet.models.values()
        ]

    def any_available(self) -> bool:
        return any(slot.usable for slot in self._dispatcher.slots.values())


class FleetKeyRing:
    """Implements ``KeyRing``: a presented key is hashed and looked up, never stored."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    @property
    def open(self) -> bool:
        return not self._dispatcher.fleet.api_keys

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        digest = hashlib.sha256(presented_key.encode()).hexdigest()
        return self._dispatcher.fleet.api_keys.get(digest)
