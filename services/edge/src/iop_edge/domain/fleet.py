"""The fleet as the edge serves it: models, providers, API keys (from the control-plane).

Immutable: a config push builds a new ``Fleet`` and swaps it in whole, so a
request never sees half of an update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from iop_edge.domain.controls import ControlEntry

DEFAULT_MAX_OUTPUT_TOKENS: Final = 32_768
"""A model's output cap when the fleet file gives none: above any model's real output
length today, and far below a max_tokens that would hold a slot for hours."""
DEFAULT_RETRIES: Final = 2
"""How many times a model's run that failed before its first byte is run again on another
provider when the fleet file says nothing (docs/ARCHITECTURE.md#failover)."""


class Operation(StrEnum):
    CHAT_COMPLETIONS = "chat_completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    COUNT_TOKENS = "count_tokens"
    """A chat body's prompt tokens from the provider's tokenizer, nothing generated
    (Anthropic's ``count_tokens``): the edge's own, never in the fleet file."""


PUBLIC_OPERATIONS: Final = (
    Operation.CHAT_COMPLETIONS,
    Operation.COMPLETIONS,
    Operation.EMBEDDINGS,
)
"""What the fleet file lists and the catalog shows, in this order."""
ALL_OPERATIONS: Final = frozenset(PUBLIC_OPERATIONS)
TOKENIZER_TYPES: Final = frozenset({"llamacpp", "vllm", "mock"})
"""Provider types whose node adapter counts tokens with the engine's tokenizer
(``count_tokens``): llama.cpp's and vLLM's ``/tokenize``, the mock's estimate."""
TYPE_OPERATIONS: Final[Mapping[str, frozenset[Operation]]] = {
    "cli": frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS}),
}
"""What a provider type offers when the fleet file lists no ``operations`` (a type not
named here: all of them; a ``cli`` program takes a prompt and has no embeddings)."""


def default_operations(provider_type: str) -> frozenset[Operation]:
    return TYPE_OPERATIONS.get(provider_type, ALL_OPERATIONS)


def offered_operations(provider_type: str, listed: Iterable[Operation]) -> frozenset[Operation]:
    """What a provider offers: the fleet file's list (none: its type's default), and
    ``count_tokens`` where its type has a tokenizer to ask."""
    operations = frozenset(listed) or default_operations(provider_type)
    if provider_type in TOKENIZER_TYPES:
        return operations | {Operation.COUNT_TOKENS}
    return operations


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One public model: its id is the queue and catalog key
    (docs/ARCHITECTURE.md#target-rewrite)."""

    id: str
    display_name: str
    providers: Mapping[str, str]  # provider id -> served name, in the fleet file's order
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS  # the most max_tokens a request may ask
    retries: int = DEFAULT_RETRIES  # failovers per run before the first byte; 0 = none
    context_window: int = 0  # the model's context in tokens (fleet file); 0 = not said
    preference: tuple[str, ...] = ()  # an operator's provider order (domain.controls)


@dataclass(frozen=True, slots=True)
class ProviderEntry:
    """One provider as the fleet file declares it (live state lives in the pool)."""

    id: str
    node_id: str
    type: str
    category: str
    models: tuple[str, ...]
    capacity: int
    max_queue: int
    queue_timeout_ms: int
    request_timeout_ms: int
    operations: frozenset[Operation] = ALL_OPERATIONS  # what it offers (the fleet file's word)
    # runtime control (domain.controls): "disabled", "draining" (``capacity`` is then 0,
    # out of selection) or ""; the fleet file's capacity when an operator's overrides it
    control_state: str = ""
    declared_capacity: int = 0
    held_capacity: int = 0  # a held provider's capacity once it serves again (views only)


class BudgetPeriod(StrEnum):
    """The period a key's token budget renews over (calendar periods, UTC)."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """How much a key (or a key on one model) may use; 0 in a field = no limit of that kind.

    ``max_concurrent`` is read for per-model limits only: the key's own stays
    ``ApiKeyEntry.max_concurrent`` (the field it had before rates existed).
    """

    requests_per_minute: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    token_budget: int = 0  # input + output tokens per budget_period
    budget_period: BudgetPeriod = BudgetPeriod.MONTH
    max_concurrent: int = 0

    @property
    def unlimited(self) -> bool:
        return not (
            self.requests_per_minute
            or self.input_tokens_per_minute
            or self.output_tokens_per_minute
            or self.token_budget
            or self.max_concurrent
        )


NO_LIMITS = KeyLimits()


@dataclass(frozen=True, slots=True)
class ApiKeyEntry:
    """An API key's policy; the key itself is never known to the edge, only its sha256."""

    key_id: str
    name: str
    key_hash: str
    models: frozenset[str]  # empty = every model
    max_concurrent: int  # 0 = unlimited
    operator: bool = False  # sees and acts on every key's files, batches and runs
    limits: KeyLimits = NO_LIMITS  # the whole key's rates and budget
    model_limits: Mapping[str, KeyLimits] = field(default_factory=dict)  # on top, per model
    weight: int = 1  # its share of turns in a model's queue (at least 1)
    priority: int = 0  # higher is served first; 0 = the interactive default
    expires_ms: int = 0  # unix ms from which this secret is refused; 0 = never

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def expired(self, now_ms: int) -> bool:
        """Whether the secret this entry was found by is refused at ``now_ms``."""
        return 0 < self.expires_ms <= now_ms


@dataclass(frozen=True, slots=True)
class Fleet:
    version: int = 0
    models: Mapping[str, ModelEntry] = field(default_factory=dict)
    providers: Mapping[str, ProviderEntry] = field(default_factory=dict)
    api_keys: Mapping[str, ApiKeyEntry] = field(default_factory=dict)  # by key_hash
    revoked_token_ids: frozenset[str] = frozenset()
    # a rotation's previous secrets, by their hash: the same key (id, policy) with the
    # overlap's end as its expiry; apart so that each key is listed once in api_keys. Also
    # secrets that expired lately (no policy, their expiry past): refused as expired
    previous_keys: Mapping[str, ApiKeyEntry] = field(default_factory=dict)
    controls: tuple[ControlEntry, ...] = ()  # the operators' runtime controls in force
    # a key was ever issued (revoked and expired ones count): keys are required even while
    # none is live (the control-plane says so; one from before it sends False)
    keys_required: bool = False

    def models_of_provider(self, provider_id: str) -> list[str]:
        return [m.id for m in self.models.values() if provider_id in m.providers]

    def queue_limits(self, model_id: str) -> tuple[int, float]:
        """A model's queue: room for its providers' ``max_queue`` together, and the
        longest of their ``queue_timeout_ms`` (the queue serves the whole pool)."""
        entries = [
            self.providers[p] for p in self.models[model_id].providers if p in self.providers
        ]
        if not entries:
            return 0, 0.0
        return (
            sum(e.max_queue for e in entries),
            max(e.queue_timeout_ms for e in entries) / 1000,
        )
