"""Rendezvous (highest random weight) hashing: the provider a new session starts on, the
same on every edge that sees the same providers
(docs/ARCHITECTURE.md#limits-and-affinity-across-edges).

Each provider scores ``-capacity / ln(u)``, ``u`` a uniform number in (0, 1) drawn from a
hash of (session, provider id); the highest score wins. So the choice needs no state and
no coordination: two edges given the same session and the same candidates agree. A
provider wins a share of sessions proportional to its capacity (the logarithmic method of
weighted rendezvous hashing), and when one leaves, only its own sessions move: every
other provider's score for a session is unchanged.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Final

from iop_edge.domain.pool import ProviderSlot

_SCALE: Final = float(2**64)


def score(session: str, provider_id: str, capacity: int) -> float:
    """The provider's weight for the session; higher wins."""
    # Keys are client text: a header's undecodable bytes come as surrogate escapes.
    data = f"{session}\x00{provider_id}".encode("utf-8", "surrogatepass")
    drawn = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    u = (drawn + 0.5) / _SCALE  # strictly inside (0, 1): ln(u) < 0
    return -capacity / math.log(u)


def ranked(session: str, slots: Iterable[ProviderSlot]) -> Sequence[ProviderSlot]:
    """``slots`` from the session's first choice to its last (ties: the provider id)."""
    return sorted(
        slots,
        key=lambda slot: (-score(session, slot.provider_id, slot.capacity), slot.provider_id),
    )
