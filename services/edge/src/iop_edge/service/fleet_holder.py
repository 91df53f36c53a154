"""The fleet config in force: one holder, replaced whole, read by everyone else.

The control-plane pushes a new ``Fleet``; the provider registry puts it here
(``ProviderRegistry.apply_fleet``) before it rebuilds the pool, so whoever reads
``current`` afterwards sees the fleet the pool was built from. The API keys come with
the fleet: the holder is the key ring too.
"""

from __future__ import annotations

import hashlib

from iop_edge.domain.fleet import ApiKeyEntry, Fleet


class FleetHolder:
    """Implements ``FleetView`` and ``KeyRing``: the current fleet, empty until the first
    config, and its API keys (a presented key is hashed and looked up, never stored).

    ``current``, ``configured`` and ``open`` are plain attributes, not properties: the fleet
    held is never changed in place, so whoever reads it gets a whole fleet, and whether it
    has keys is known when it arrives. Only ``replace`` assigns them.

    Until the first fleet arrives (from the control-plane, or the edge's cached copy) the
    ring is not open: nobody knows yet whether keys are required, and an open API serves
    loopback clients as operators (every key's runs, files and batches, the controls).
    """

    __slots__ = ("configured", "current", "open")

    def __init__(self, fleet: Fleet | None = None) -> None:
        self.current = fleet if fleet is not None else Fleet()
        self.configured = fleet is not None
        self.open = self.configured and _open(self.current)

    def replace(self, fleet: Fleet) -> None:
        self.current = fleet
        self.configured = True
        self.open = _open(fleet)

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        digest = hashlib.sha256(presented_key.encode()).hexdigest()
        fleet = self.current
        # a rotation's previous secret only when the current one is not it (rare, and
        # one more dict look-up only for a key that is not found at first)
        return fleet.api_keys.get(digest) or fleet.previous_keys.get(digest)


def _open(fleet: Fleet) -> bool:
    """No key ever issued: the API is open (loopback only, unless ``allow_open``).

    The control-plane says whether a key was ever issued (``keys_required``): revoking
    the last live key, or its expiry, must not open the API, or the revoked or expired
    key, and any other, would be served from loopback. A control-plane from before that
    field says nothing; then the keys it sends count, the expired ones included (it lists
    an expired key for a week so that it is refused saying so).
    """
    return not (fleet.keys_required or fleet.api_keys or fleet.previous_keys)
