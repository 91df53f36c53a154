"""Runtime control of the fleet (docs/ARCHITECTURE.md#runtime-control): what an operator
set at runtime on top of the fleet file, and the trail of every change.

Three kinds of control, each keyed by ``(kind, target)``, at most one in force per key:

- ``state``: a node (``node``) or a provider (``node/provider``) is ``disabled`` or
  ``draining``; none in force: serving. Both take the provider out of selection; the
  node hands runs still queued for it back (retriable), runs under way finish. They
  differ in what the operator means (and what the catalog says): draining ends in
  "drained" once nothing is in flight.
- ``capacity``: a provider's capacity in place of the fleet file's.
- ``prefer``: a model's providers in the order to try them (the first listed with a
  free slot wins); the ones not listed come after, by the normal rule.

A change is refused (``ControlRefused``) when its target is not in the fleet file: a
control of nothing would linger unseen. One that outlives its target (the fleet file
lost the provider) stays stored and does nothing, so it is back if the provider is.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from iop_control_plane.domain.fleet import FleetSpec
from iop_control_plane.errors import ControlPlaneError

KINDS: Final = ("state", "capacity", "prefer")
STATES: Final = ("disabled", "draining")
MAX_CAPACITY: Final = 1_000_000
CHANGE_ID_PREFIX: Final = "chg_"
AUDIT_DEFAULT: Final = 100
AUDIT_MAX: Final = 10_000
_CHANGE_ID: Final = re.compile(r"chg_[0-9a-f]{12}")


class ControlRefused(ControlPlaneError, ValueError):
    """A change that cannot be made; ``code``: ``invalid`` or ``not_found``."""

    def __init__(self, message: str, code: str = "invalid") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Control:
    """One control in force, and the change that set it."""

    kind: str
    target: str
    value: str
    change_id: str
    changed_by: str
    changed_at: datetime
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ControlChange:
    """One entry of the audit trail: ``before`` and ``after`` are values, "" for none."""

    change_id: str
    at: datetime
    changed_by: str
    kind: str
    target: str
    before: str
    after: str
    reason: str = ""
    reverts: str = ""

    def applied(self) -> Control | None:
        """The control this change leaves in force (``None``: it cleared one)."""
        if not self.after:
            return None
        return Control(
            self.kind,
            self.target,
            self.after,
            self.change_id,
            self.changed_by,
            self.at,
            self.reason,
        )


def new_change_id() -> str:
    return CHANGE_ID_PREFIX + secrets.token_hex(6)


def check_change_id(change_id: str) -> str:
    if not _CHANGE_ID.fullmatch(change_id):
        raise ControlRefused(f"{change_id!r} is not a change id (chg_ and 12 hex digits)")
    return change_id


def checked_value(kind: str, target: str, value: str, fleet: FleetSpec) -> str:
    """``value`` for ``(kind, target)`` in its stored form ("" clears), or ``ControlRefused``."""
    if kind not in KINDS:
        raise ControlRefused(f"unknown control {kind!r}: one of {', '.join(KINDS)}")
    if kind == "prefer":
        return _checked_preference(target, value, fleet)
    node_id, _, provider_id = target.partition("/")
    nodes = {node.id: node for node in fleet.nodes}
    node = nodes.get(node_id)
    if node is None:
        raise ControlRefused(f"no node {node_id!r} in the fleet", "not_found")
    if provider_id and provider_id not in {p.id for p in node.providers}:
        raise ControlRefused(f"no provider {provider_id!r} on node {node_id!r}", "not_found")
    if kind == "capacity" and not provider_id:
        raise ControlRefused("a capacity is a provider's: name it as NODE/PROVIDER")
    if not value:
        return ""
    if kind == "state":
        if value not in STATES:
            raise ControlRefused(f"state {value!r}: one of {', '.join(STATES)}")
        return value
    if not value.isdigit() or not 1 <= int(value) <= MAX_CAPACITY:
        raise ControlRefused(f"capacity {value!r}: a whole number from 1 to {MAX_CAPACITY}")
    return str(int(value))


def _checked_preference(model_id: str, value: str, fleet: FleetSpec) -> str:
    model = next((m for m in fleet.models if m.id == model_id), None)
    if model is None:
        raise ControlRefused(f"no model {model_id!r} in the fleet", "not_found")
    listed = [p.strip() for p in value.split(",") if p.strip()]
    for provider_id in listed:
        if provider_id not in model.providers:
            raise ControlRefused(
                f"provider {provider_id!r} does not serve {model_id!r}", "not_found"
            )
    if len(set(listed)) != len(listed):
        raise ControlRefused("a provider is listed twice")
    return ",".join(listed)


@dataclass(frozen=True, slots=True)
class ProviderControl:
    """What the controls make of one provider: its state ("" serving) and capacity
    override (0: the fleet file's)."""

    state: str = ""
    capacity: int = 0


SERVING: Final = ProviderControl()


def provider_controls(controls: Iterable[Control]) -> Mapping[tuple[str, str], ProviderControl]:
    """Each controlled provider's ``ProviderControl`` by ``(node id, provider id)``; a node's
    state is every provider's of it (``("node", "")``), ``disabled`` over ``draining``."""
    found: dict[tuple[str, str], ProviderControl] = {}
    for control in controls:
        if control.kind == "prefer":
            continue
        node_id, _, provider_id = control.target.partition("/")
        key = (node_id, provider_id)
        current = found.get(key, SERVING)
        if control.kind == "state":
            found[key] = ProviderControl(control.value, current.capacity)
        else:
            found[key] = ProviderControl(current.state, int(control.value))
    return found


def effective(
    found: Mapping[tuple[str, str], ProviderControl], node_id: str, provider_id: str
) -> ProviderControl:
    """The provider's own control with its node's state laid over it."""
    own = found.get((node_id, provider_id), SERVING)
    node_state = found.get((node_id, ""), SERVING).state
    states = {own.state, node_state}
    state = "disabled" if "disabled" in states else ("draining" if "draining" in states else "")
    return ProviderControl(state, own.capacity)
