"""Runtime controls on the wire (``domain.controls`` <-> ``pb.RuntimeControl...``), and
baked into the ``NodeConfig`` a node receives: its providers' state and capacity override
travel in ``ProviderConfig`` (``control_state``, ``capacity`` with ``declared_capacity``),
so the node acts on them without knowing any control, and an edge sees them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime

from iop_control_plane.domain.controls import (
    Control,
    ControlChange,
    ProviderControl,
    effective,
)
from iop_proto.v1 import runtime_pb2 as pb


def _unix_ms(moment: datetime) -> int:
    return math.floor(moment.timestamp() * 1000)


def control_to_proto(control: Control) -> pb.RuntimeControl:
    return pb.RuntimeControl(
        kind=control.kind,
        target=control.target,
        value=control.value,
        change_id=control.change_id,
        changed_by=control.changed_by,
        changed_unix_ms=_unix_ms(control.changed_at),
        reason=control.reason,
    )


def change_to_proto(change: ControlChange) -> pb.RuntimeControlChange:
    return pb.RuntimeControlChange(
        change_id=change.change_id,
        at_unix_ms=_unix_ms(change.at),
        changed_by=change.changed_by,
        kind=change.kind,
        target=change.target,
        before=change.before,
        after=change.after,
        reason=change.reason,
        reverts=change.reverts,
    )


def bake_controls(
    node: pb.NodeConfig, found: Mapping[tuple[str, str], ProviderControl]
) -> pb.NodeConfig:
    """``node`` (fresh from ``node_config_to_proto``) with its providers' controls in it."""
    if not found:
        return node
    for provider in node.providers:
        control = effective(found, node.node_id, provider.id)
        provider.control_state = control.state
        if control.capacity:
            provider.declared_capacity = provider.capacity
            provider.capacity = control.capacity
    return node


def controls_to_proto(controls: Iterable[Control]) -> list[pb.RuntimeControl]:
    return [control_to_proto(c) for c in sorted(controls, key=lambda c: (c.kind, c.target))]
