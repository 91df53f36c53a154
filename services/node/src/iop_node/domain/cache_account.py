"""What a provider's engine holds in its prompt cache, as the node saw it serve.

The edge chooses a provider for a conversation's next turn by where its prompt prefix is
cached (docs/ARCHITECTURE.md#cache-affinity). The edge only knows what it sent where;
the node sits beside the engine and sees what it served and how many prompt tokens came
from its cache, so each provider's snapshot carries this account (``CacheState``).

A served prompt is named by its chain of block hashes (``iop_proto.prefix``, the edge's
rule too) and kept as its last hash and length. The engine keeps the prompts it served
last (llama.cpp's slots and host prompt cache, vLLM's prefix cache, both LRU), so the
account keeps the ``limit`` most recent, newest first. A prompt that extends one kept
already (an agent's next turn) replaces it: the engine holds the longer one now, and one
conversation takes one place of the bound instead of one per turn.

The account is the engine's cache as the node saw it fill; when the engine is seen down
or restarted (``forget``) that cache is gone, and so are the prefixes. The token totals
stay: they count the answers since the node started, which the cache's loss does not
undo.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CACHE_PREFIXES = 32
"""Prompts kept per provider (``NodeSettings.cache_prefixes``): a few per slot of an
engine that serves several conversations at once."""
RATE_DECAY = 0.8
"""Weight of the prefill rate's past per answer: the last ten or so answers count."""


@dataclass(frozen=True, slots=True)
class CacheView:
    """The account at one moment (``CacheAccount.view``), for the provider's snapshot and
    a run's end."""

    prefixes: tuple[tuple[int, int], ...] = ()
    """(last block hash, blocks) of the prompts served last, most recent first."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_ms_per_token: float | None = None


class CacheAccount:
    """One provider's prompts served and prompt tokens cached (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must be at least 0")
        self.limit = limit
        self.view = CacheView()
        """The account as it stands: a value replaced by each change, never changed itself,
        so whoever holds one (a snapshot) keeps what it said then."""
        # The prefill rate is a token-weighted moving average: an answer that evaluated
        # 8 tokens after a cache hit says little about the rate next to one that
        # evaluated 5,000.
        self._rate_ms = 0.0
        self._rate_tokens = 0.0

    def served(
        self,
        chain: Sequence[int],
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        prefill_ms_per_token: float | None = None,
    ) -> None:
        """The engine answered a prompt whose block hashes are ``chain`` (empty: a prompt
        without a whole block, not kept) with these token counts."""
        evaluated = prompt_tokens - cached_tokens
        if prefill_ms_per_token is not None and evaluated > 0:
            self._rate_ms = self._rate_ms * RATE_DECAY + prefill_ms_per_token * evaluated
            self._rate_tokens = self._rate_tokens * RATE_DECAY + evaluated
        prefixes = self.view.prefixes
        if chain and self.limit:
            blocks = len(chain)
            # Drop what this prompt repeats or extends: the same tail, or a shorter prompt
            # that this one starts with.
            kept = [
                (tail, length)
                for tail, length in prefixes
                if not (length <= blocks and chain[length - 1] == tail)
            ]
            kept.insert(0, (chain[-1], blocks))
            prefixes = tuple(kept[: self.limit])
        self.view = CacheView(
            prefixes,
            self.view.prompt_tokens + prompt_tokens,
            self.view.cached_tokens + min(cached_tokens, prompt_tokens),
            self._rate_ms / self._rate_tokens if self._rate_tokens else None,
        )

    def forget(self) -> None:
        """The engine's cache is gone (it was seen down, or serving other models)."""
        self.view = dataclasses.replace(self.view, prefixes=())
