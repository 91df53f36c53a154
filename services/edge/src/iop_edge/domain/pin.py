"""A request pinned to one provider of its model (docs/ARCHITECTURE.md#qualification-reports).

An operator measures one provider at a time through the pool (``iopctl qualify``): the
``x-iop-provider`` header names it, and the run is dispatched as any other but with
every other provider of the model excluded, for its first attempt and any retry (the
dispatcher's own ``exclude``, which failover already uses: no second selection path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class PinTarget(Protocol):
    provider_id: str
    node_id: str


class PinUnknown(ValueError):
    """The pin names no provider of the model."""


def pinned_out(pin: str, members: Iterable[PinTarget]) -> frozenset[str]:
    """The ids of the model's providers other than the one ``pin`` names
    (``PROVIDER`` or ``NODE/PROVIDER``); raises ``PinUnknown`` when none matches."""
    node, _, provider = pin.rpartition("/")
    others: set[str] = set()
    found = False
    for member in members:
        if member.provider_id == provider and node in ("", member.node_id):
            found = True
        else:
            others.add(member.provider_id)
    if not found:
        raise PinUnknown(pin)
    return frozenset(others)
