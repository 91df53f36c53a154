"""What an API key may use beyond its model list: rates, a token budget, its share and rank.

The edge enforces them (docs/ARCHITECTURE.md#limits-per-key); the control plane keeps
them with the key, changes them (``key update``) and sends them in the fleet
configuration. One JSON document per key holds the key's own limits and its per-model
ones, so the SQLite and PostgreSQL stores keep the same text and neither needs a table
per model. Pure: no storage, no clock.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from iop_control_plane.errors import CredentialError


class BudgetPeriod(StrEnum):
    """The calendar period (UTC) a token budget renews over."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """How much a key (or a key on one model) may use; 0 in a field = no limit of that kind.

    ``max_concurrent`` is read for per-model limits only: a key's own is
    ``ApiKey.max_concurrent`` (the field it had before rates existed).
    """

    requests_per_minute: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    token_budget: int = 0  # input + output tokens per budget_period
    budget_period: BudgetPeriod = BudgetPeriod.MONTH
    max_concurrent: int = 0

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise CredentialError(f"{name} must be 0 (no limit) or more (got {value!r})")

    @property
    def unlimited(self) -> bool:
        return not any(getattr(self, name) for name in _COUNTS)

    def to_json(self) -> dict[str, Any]:
        """The fields that are set (a budget with its period); ``{}`` when none is."""
        shown: dict[str, Any] = {n: getattr(self, n) for n in _COUNTS if getattr(self, n)}
        if self.token_budget:
            shown["budget_period"] = self.budget_period.value
        return shown

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KeyLimits:
        try:
            period = BudgetPeriod(data.get("budget_period", BudgetPeriod.MONTH))
        except ValueError:
            raise CredentialError(
                f"budget period must be one of {', '.join(BudgetPeriod)}"
            ) from None
        return cls(**{name: int(data.get(name, 0)) for name in _COUNTS}, budget_period=period)


_COUNTS: Final = (
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "token_budget",
    "max_concurrent",
)
NO_LIMITS: Final = KeyLimits()

ModelLimits = tuple[tuple[str, KeyLimits], ...]
"""Per-model limits, sorted by model (hashable, compared as values)."""


def dump_limits(limits: KeyLimits, model_limits: ModelLimits) -> str:
    """The stored text of a key's limits: ``{"key": {...}, "models": {model: {...}}}``."""
    document: dict[str, Any] = {}
    if not limits.unlimited:
        document["key"] = limits.to_json()
    if model_limits:
        document["models"] = {model: entry.to_json() for model, entry in model_limits}
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def load_limits(text: str) -> tuple[KeyLimits, ModelLimits]:
    """``dump_limits`` read back."""
    document = json.loads(text) if text else {}
    limits = KeyLimits.from_json(document.get("key", {}))
    models = document.get("models", {})
    return limits, tuple(sorted((m, KeyLimits.from_json(v)) for m, v in models.items()))


def with_model_limits(model_limits: ModelLimits, model: str, limits: KeyLimits) -> ModelLimits:
    """``model_limits`` with ``model``'s entry set to ``limits`` (dropped when unlimited)."""
    kept = {name: entry for name, entry in model_limits if name != model}
    if not limits.unlimited:
        kept[model] = limits
    return tuple(sorted(kept.items()))


def changed(limits: KeyLimits, **changes: Any) -> KeyLimits:
    """``limits`` with the fields given (``None``: left as it is)."""
    given: dict[str, Any] = {name: v for name, v in changes.items() if v is not None}
    return dataclasses.replace(limits, **given) if given else limits
