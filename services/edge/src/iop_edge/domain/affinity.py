"""Cache affinity: which provider a request should prefer, and how long it may wait for
it (docs/ARCHITECTURE.md#cache-affinity).

A turn of a conversation is cheap on the engine whose prompt cache holds the turns before
it, and costs a whole prefill anywhere else. ``CacheAffinity.prefer`` names that engine's
provider when it is known and its load allows; the seed's rule (lowest
``in_flight / capacity``, ``domain.pool``) decides when nothing can be reused. The rule,
in order:

1. **The session's provider**: the one this edge last gave the request's session
   (``domain.session_key``), while it is a candidate within its bounded load.
2. **The longest cached prefix**: the provider whose engine holds the longest prefix of
   the prompt, at least ``min_match_blocks`` blocks (``iop_proto.prefix``): by its
   node's report (``ProviderSlot.cache``: what the engine served, shared by every edge
   and surviving an edge's restart) or, when longer, by this edge's own record of what
   it sent where (``PrefixIndex``: prompts still in flight, or not yet reported). Ties go
   to the node's word, then to the lower load, then to the fleet file's order.
3. Nothing to reuse: no preference; but a session this edge has never placed starts on
   its rendezvous provider (``rendezvous``, within its bounded load), so every edge
   starts it on the same one.

**Bounded load** (consistent hashing with bounded loads, Mirrokni et al.): a provider
is preferred only while taking the request keeps it within ``load_factor`` times its
share of the pool's load counting this request, ``load <= load_factor * (pool load + 1) * capacity /
pool capacity``, where a provider's load counts its runs and the requests waiting for it
in particular; rounded up while it has a free slot (with few runs in flight the share
rounds to nothing, and one more turn on a warm engine costs less than a prefill
elsewhere). So one hot session, or one prefix every request shares, fills its
provider up to that bound and spills to the rest; a session that spills is remembered
where it lands and stays there (it moves once).

**The wait**: a preferred provider with no free slot may be waited for, instead of
taking a free slot elsewhere, for as long as the re-prefill the wait saves would take
there (``wait_s``): the matched tokens times the provider's prefill time per token (its
node's report; ``default_prefill_ms_per_token`` when it says nothing). Waiting up to the
cost of the alternative is the ski-rental rule: never worse than twice the better choice
made in hindsight. While no other provider has a free slot there is no alternative to
pay for (the request would queue), so the dispatcher renews the wait then, up to
``max_wait_s`` in all; then the request takes whatever the seed's rule gives it.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

from iop_edge.domain.pool import ProviderSlot, standing
from iop_edge.domain.prefix_index import PrefixIndex
from iop_edge.domain.rendezvous import ranked
from iop_proto.prefix import BLOCK_CHARS, longest_match

SESSION = "session"
PREFIX = "prefix"
RENDEZVOUS = "rendezvous"


@dataclass(frozen=True, slots=True)
class AffinityPolicy:
    """The weights of the rule (edge settings ``affinity``)."""

    enabled: bool = True
    load_factor: float = 1.25
    min_match_blocks: int = 2
    max_wait_s: float = 5.0
    default_prefill_ms_per_token: float = 1.0
    chars_per_token: float = 4.0
    max_sessions: int = 100_000
    session_ttl_s: float = 3600.0
    max_prefix_blocks: int = 65_536
    prefix_ttl_s: float = 900.0


@dataclass(frozen=True, slots=True)
class Preference:
    """The provider a request should go to, why, and how long it may wait for a slot."""

    slot: ProviderSlot
    reason: str  # SESSION or PREFIX
    matched_blocks: int
    wait_s: float  # how long it may wait while a slot is free elsewhere


class SessionTable:
    """Session key -> the provider its last turn went to; LRU-bounded, expiring."""

    __slots__ = ("_entries", "max_entries", "ttl_s")

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry[1] > self.ttl_s:
            del self._entries[key]
            return None
        return entry[0]

    def put(self, key: str, provider_id: str, now: float) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = (provider_id, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class CacheAffinity:
    """The preference rule above, with the state it reads: the sessions' providers, the
    prefixes sent, and the requests waiting for a particular provider."""

    def __init__(self, policy: AffinityPolicy) -> None:
        self.policy = policy
        self.sessions = SessionTable(policy.max_sessions, policy.session_ttl_s)
        self.prefixes = PrefixIndex(policy.max_prefix_blocks, policy.prefix_ttl_s)
        self._waiting: dict[str, int] = {}  # provider id -> requests waiting for it

    def prefer(
        self,
        model_id: str,
        members: Sequence[ProviderSlot],
        session: str | None,
        chain: Sequence[int],
        now: float,
        exclude: Container[str] = (),
    ) -> Preference | None:
        """The provider among ``members`` (the model's, in its order) the request should
        prefer, or ``None`` for the seed's rule."""
        policy = self.policy
        if not policy.enabled or (session is None and not chain):
            return None
        candidates = [
            (position, slot)
            for position, slot in enumerate(members)
            if slot.provider_id not in exclude and standing(slot) is not None
        ]
        if len(candidates) < 2:
            return None  # nothing to choose between: the seed's rule takes the one
        within = self._within_bound([slot for _, slot in candidates])
        if session is not None:
            home = self.sessions.get(session, now)
            for _, slot in candidates:
                if slot.provider_id == home and slot.provider_id in within:
                    return self._preference(
                        slot, SESSION, self._matched(model_id, slot, chain, now)
                    )
        if len(chain) < policy.min_match_blocks:
            return None
        own = self.prefixes.matches(chain, now)
        best: tuple[int, int, float, int] | None = None
        chosen: ProviderSlot | None = None
        for position, slot in candidates:
            if slot.provider_id not in within:
                continue
            reported = longest_match(chain, slot.cache.held)
            matched = max(reported, own.get(_holder(model_id, slot), 0))
            if matched < policy.min_match_blocks:
                continue
            # Longest first; then the node's word; then the lower load; then fleet order.
            load = standing(slot) or 0.0
            rank = (-matched, 0 if reported >= matched else 1, load, position)
            if best is None or rank < best:
                best, chosen = rank, slot
        if chosen is None or best is None:
            return None
        return self._preference(chosen, PREFIX, -best[0])

    def rendezvous(
        self,
        members: Sequence[ProviderSlot],
        session: str | None,
        now: float,
        exclude: Container[str] = (),
    ) -> Preference | None:
        """Where a session this edge has never placed starts, when ``prefer`` has nothing
        to reuse: its rendezvous provider (``domain.rendezvous``) among the candidates
        within their bounded load, the same whichever edge the turn reaches; ``None``
        for a session this edge remembers (its table decides) or nothing to choose.

        It is never waited for (nothing is cached there yet): without a free slot the
        seed's rule decides, and the session is remembered where it lands."""
        if not self.policy.enabled or session is None or self.sessions.get(session, now):
            return None
        candidates = [
            slot
            for slot in members
            if slot.provider_id not in exclude and standing(slot) is not None
        ]
        if len(candidates) < 2:
            return None
        within = self._within_bound(candidates)
        for slot in ranked(session, candidates):
            if slot.provider_id in within:
                return Preference(slot, RENDEZVOUS, 0, 0.0)
        return None

    def placed(
        self,
        model_id: str,
        slot: ProviderSlot,
        session: str | None,
        chain: Sequence[int],
        now: float,
        also: str | None = None,
    ) -> None:
        """The request went to ``slot``: its session lives there now (and under ``also``,
        the key its successor will name, e.g. a Responses id), its prefix too."""
        if not self.policy.enabled:
            return
        for key in (session, also):
            if key is not None:
                self.sessions.put(key, slot.provider_id, now)
        if chain:
            self.prefixes.record(chain, _holder(model_id, slot), now)

    # ------------------------------------------------------------ waiting for a provider

    def waiting(self, provider_id: str, step: int) -> None:
        """A request starts (+1) or stops (-1) waiting for this provider in particular."""
        count = self._waiting.get(provider_id, 0) + step
        if count > 0:
            self._waiting[provider_id] = count
        else:
            self._waiting.pop(provider_id, None)

    def waiters(self, provider_id: str) -> int:
        return self._waiting.get(provider_id, 0)

    # ------------------------------------------------------------ the parts of the rule

    def _within_bound(self, slots: Sequence[ProviderSlot]) -> set[str]:
        """The providers that may take one more request under the bounded-load rule."""
        loads = [(slot, slot.in_flight + self.waiters(slot.provider_id)) for slot in slots]
        pool_load = sum(load for _, load in loads)
        pool_capacity = sum(slot.capacity for slot in slots)
        factor = self.policy.load_factor * (pool_load + 1) / pool_capacity
        within: set[str] = set()
        for slot, load in loads:
            share = factor * slot.capacity
            # Rounded up for a free slot: with few runs in flight the share rounds to
            # nothing, and one more turn on a warm engine costs less than a prefill elsewhere.
            if load <= (math.ceil(share) if load < slot.capacity else share):
                within.add(slot.provider_id)
        return within

    def _matched(self, model_id: str, slot: ProviderSlot, chain: Sequence[int], now: float) -> int:
        if not chain:
            return 0
        reported = longest_match(chain, slot.cache.held)
        own = self.prefixes.matches(chain, now).get(_holder(model_id, slot), 0)
        return max(reported, own)

    def _preference(self, slot: ProviderSlot, reason: str, matched: int) -> Preference:
        return Preference(slot, reason, matched, self._wait_s(slot, matched))

    def _wait_s(self, slot: ProviderSlot, matched_blocks: int) -> float:
        """How long a request may wait for ``slot`` while another has a free slot: the
        re-prefill it saves, bounded."""
        policy = self.policy
        per_token_ms = slot.cache.prefill_ms_per_token or policy.default_prefill_ms_per_token
        tokens = matched_blocks * BLOCK_CHARS / policy.chars_per_token
        return min(policy.max_wait_s, tokens * per_token_ms / 1000)


def _holder(model_id: str, slot: ProviderSlot) -> str:
    # Interned: the index keeps one copy per holder, not one per block it was sent.
    return sys.intern(f"{model_id}\x00{slot.provider_id}")
