"""API keys' requests in progress counted in this edge alone: the default, for one edge.

Acquire and release never suspend, so on one event loop the counts are exact; the
store every edge shares (``pg_key_slots``) takes over when the edge has a ``postgres``
section (docs/ARCHITECTURE.md#limits-and-affinity-across-edges).
"""

from __future__ import annotations

from iop_edge.ports import KeySlot


class LocalKeyConcurrency:
    """``KeyConcurrency`` in one process: a count per key."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def held(self, key_id: str) -> int:
        return self._held.get(key_id, 0)

    async def acquire(self, key_id: str, limit: int) -> KeySlot | None:
        held = self._held.get(key_id, 0)
        if held >= limit:
            return None
        self._held[key_id] = held + 1
        return KeySlot(key_id, "")

    async def release(self, slot: KeySlot) -> None:
        left = self._held.get(slot.key_id, 0) - 1
        if left > 0:
            self._held[slot.key_id] = left
        else:
            self._held.pop(slot.key_id, None)
