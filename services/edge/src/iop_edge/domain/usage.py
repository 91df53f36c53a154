"""Who used what: the public APIs a run is made through, a key's usage in a window, and
the windows a key's limits are measured over (docs/ARCHITECTURE.md#usage-per-key).

Pure: the run log's adapters add up the rows, the usage service lays them beside each
key's limits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from iop_edge.domain.fleet import BudgetPeriod
from iop_edge.domain.key_rates import period_bounds


class Api(StrEnum):
    """The public API a run was asked through (the run log's ``api``, the metrics' label).

    Responses and Messages run as chat completions on every provider (the run log's
    ``operation``); this says which door the client came in by. A batch line is
    ``batch`` whatever its endpoint.
    """

    CHAT_COMPLETIONS = "chat_completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    MESSAGES = "messages"  # Anthropic's, ``count_tokens`` included
    BATCH = "batch"


ERROR_OUTCOMES: Final = ("failed", "rejected")
"""Outcomes counted as errors: the edge or the provider failed the request, or the edge
turned it away (a limit, validation). A client that left (``cancelled``) is not one."""

MINUTE_MS: Final = 60_000


@dataclass(frozen=True, slots=True)
class UsageRow:
    """What one key did with one model through one API in a window (sums of runs)."""

    key_id: str
    model: str
    api: str
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def plus(self, other: UsageRow) -> UsageRow:
        return UsageRow(
            self.key_id,
            self.model,
            self.api,
            self.requests + other.requests,
            self.errors + other.errors,
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
        )


def merge_rows(rows: Iterable[UsageRow]) -> list[UsageRow]:
    """Rows of the same key, model and API added into one, in first-seen order."""
    merged: dict[tuple[str, str, str], UsageRow] = {}
    for row in rows:
        group = (row.key_id, row.model, row.api)
        seen = merged.get(group)
        merged[group] = row if seen is None else seen.plus(row)
    return list(merged.values())


def period_start_ms(period: BudgetPeriod | None, now_ms: int) -> int:
    """The start of the calendar period holding ``now_ms``, in Unix ms: the budget's own
    period (``key_rates.period_bounds``, the one rule the limiter counts by); ``None``:
    the trailing minute (the per-minute limits')."""
    if period is None:
        return now_ms - MINUTE_MS
    start_s, _ = period_bounds(period, now_ms / 1000)
    return start_s * 1000


@dataclass(frozen=True, slots=True)
class Counts:
    """Runs and tokens added up (of one window, key, API or model)."""

    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.requests + other.requests,
            self.errors + other.errors,
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
        )

    @property
    def tokens(self) -> int:
        """Input and output together: what a token budget counts."""
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class WindowUsage:
    """One key's usage in one window: in all, by API and by model."""

    total: Counts
    by_api: dict[str, Counts]
    by_model: dict[str, Counts]


def window_usage(rows: Iterable[UsageRow], key_id: str) -> WindowUsage:
    """``key_id``'s rows of one window, added up in all, by API and by model."""
    total = Counts()
    by_api: dict[str, Counts] = {}
    by_model: dict[str, Counts] = {}
    for row in rows:
        if row.key_id != key_id:
            continue
        counts = Counts(row.requests, row.errors, row.input_tokens, row.output_tokens)
        total += counts
        by_api[row.api] = by_api.get(row.api, Counts()) + counts
        by_model[row.model] = by_model.get(row.model, Counts()) + counts
    return WindowUsage(total, by_api, by_model)
