"""Runtime controls as the edge serves them (docs/ARCHITECTURE.md#runtime-control).

The control-plane keeps them and pushes them in the fleet config: a provider's state
(``disabled``, ``draining``) and capacity override come baked into its provider config,
and the edge leaves a provider with a state out of selection by giving its slot no
capacity (``adapters.fleet_proto``), so the selection rule itself is untouched. A
model's preference orders its providers in tiers (``preference_tiers``): the first
listed with a free slot wins, then the next; those not listed come last, by the
normal rule (load, then fleet order) among themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

SERVING: Final = "serving"
DRAINED: Final = "drained"


@dataclass(frozen=True, slots=True)
class ControlEntry:
    """One control in force, as the control-plane pushed it (``pb.RuntimeControl``)."""

    kind: str
    target: str
    value: str
    change_id: str
    changed_by: str
    changed_ms: int
    reason: str = ""

    def view(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "value": self.value,
            "change_id": self.change_id,
            "changed_by": self.changed_by,
            "changed_at_ms": self.changed_ms,
            "reason": self.reason,
        }


def preference_tiers(provider_ids: Sequence[str], preference: Sequence[str]) -> tuple[int, ...]:
    """Each provider's tier, in ``provider_ids``' order: its place in ``preference``, or
    ``len(preference)`` when not listed. Added to a load ratio below 1 (a free slot), the
    tier makes the order (tier, load, fleet position): strict preference first."""
    rank = {provider_id: tier for tier, provider_id in enumerate(preference)}
    unlisted = len(preference)
    return tuple(rank.get(provider_id, unlisted) for provider_id in provider_ids)


def preferences(controls: Iterable[ControlEntry]) -> dict[str, tuple[str, ...]]:
    """Each model's preference (``prefer`` controls), by model id."""
    return {
        c.target: tuple(p for p in c.value.split(",") if p) for c in controls if c.kind == "prefer"
    }


def provider_control_view(
    node_id: str,
    provider_id: str,
    state: str,
    declared_capacity: int,
    in_flight: int,
    controls: Iterable[ControlEntry],
    held_capacity: int = 0,
) -> dict[str, Any]:
    """A provider's runtime control for the catalog: its state (``draining`` while runs of
    it are in flight, then ``drained``), its capacity override, and who set what, when.
    A held provider's capacity is 0 in the view (the truth selection uses, so its load
    reads 100%); ``held_capacity`` is the one it serves with once enabled, so a console or
    ``iopctl`` can show ``0/2 drained`` rather than a bare ``0/0``."""
    mine = [
        c.view()
        for c in controls
        if c.kind != "prefer" and c.target in (node_id, f"{node_id}/{provider_id}")
    ]
    shown = state or SERVING
    if state == "draining" and in_flight == 0:
        shown = DRAINED
    return {
        "state": shown,
        "in_flight": in_flight,
        "capacity_override": declared_capacity > 0,
        "declared_capacity": declared_capacity or None,
        "held_capacity": held_capacity if state else None,
        "controls": mine,
    }
