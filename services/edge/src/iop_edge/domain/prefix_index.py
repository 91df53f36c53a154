"""What this edge sent where: an approximate prefix tree per provider, bounded and expiring
(docs/ARCHITECTURE.md#cache-affinity).

The Rust routers' ``cache_aware`` policy keeps a radix tree of the text each worker was
sent and routes to the longest match. Here the tree is flattened into its nodes: a
prompt is a chain of block hashes (``iop_proto.prefix``), each naming the whole prefix
up to its block, so "the tree" is a map from block hash to the holders that were sent
that prefix and when. A match walks the request's chain from the start while some holder
has every block so far; the walk stops at the first block nobody has.

Bounded: at most ``max_blocks`` block hashes, the least recently sent evicted first (an
engine's cache is an LRU too, so the oldest prefixes are the likeliest gone). Expiring:
a holder not sent a prefix for ``ttl_s`` no longer matches it (an engine's cache does
not keep a prefix forever either), and is dropped when its block is next touched.
Holders are strings chosen by the caller (the dispatcher uses ``model\\x00provider``:
one provider's engines for two models share no cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Block hash -> {holder: when it was last sent that prefix}; LRU over blocks."""

    __slots__ = ("_blocks", "max_blocks", "ttl_s")

    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, chain: Sequence[int], holder: str, now: float) -> None:
        """``holder`` was sent the prompt whose chain is ``chain`` at ``now``."""
        if self.max_blocks <= 0:
            return
        blocks = self._blocks
        # The last blocks of a long chain go first when the bound is tighter than one
        # prompt: the start of a prompt is what the next turn shares.
        for block in chain[: self.max_blocks]:
            holders = blocks.get(block)
            if holders is None:
                blocks[block] = {holder: now}
            else:
                holders[holder] = now
                blocks.move_to_end(block)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def matches(self, chain: Sequence[int], now: float) -> dict[str, int]:
        """For each holder that has the chain's first block, how many leading blocks of
        ``chain`` it has (sent within ``ttl_s``)."""
        matched: dict[str, int] = {}
        oldest = now - self.ttl_s
        for length, block in enumerate(chain, start=1):
            holders = self._blocks.get(block)
            if not holders:
                break
            extended = False
            for holder, sent in list(holders.items()):
                if sent < oldest:
                    del holders[holder]  # expired: its engine has likely dropped it
                elif matched.get(holder, 0) == length - 1:
                    matched[holder] = length
                    extended = True
            if not extended:
                break
        return matched
