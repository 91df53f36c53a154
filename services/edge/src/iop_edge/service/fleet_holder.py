"""The fleet config in force: one holder, replaced whole, read by everyone else.

The control-plane pushes a new ``Fleet``; the provider registry puts it here
(``ProviderRegistry.apply_fleet``) before it rebuilds the pool, so whoever reads
``current`` afterwards sees the fleet the pool was built from.
"""

from __future__ import annotations

from iop_edge.domain.fleet import Fleet


class FleetHolder:
    """Implements ``FleetView``: the current fleet, empty until the first config.

    ``current`` is a plain attribute, not a property: the fleet it holds is never
    changed in place, so whoever reads it gets a whole fleet. Only ``replace`` assigns it.
    """

    __slots__ = ("current",)

    def __init__(self, fleet: Fleet | None = None) -> None:
        self.current = fleet if fleet is not None else Fleet()

    def replace(self, fleet: Fleet) -> None:
        self.current = fleet
