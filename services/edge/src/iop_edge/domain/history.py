"""The run log as time series: runs added up per time bucket, model and provider, and the
series the console plots from them (docs/ARCHITECTURE.md#console-history).

Pure: the run log's adapters add up the rows (one ``GROUP BY`` over a time range), the
history service turns them into series.

Queue depth is not sampled: it is derived from each run's wait, by Little's law. A
bucket's mean queue depth is the time its runs spent queued divided by its length
(``queue_wait_ms`` summed over the runs received in it, over ``step_ms``). So the series
is every edge's (the shared log), survives a restart, covers any past range, and costs no
sampling task; a wait is counted in the bucket its run arrived in, exact while waits are
shorter than a bucket, and a run is in it once it has ended (the live queue is the
catalog's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

MAX_BUCKETS: Final = 1_440
"""The most buckets one answer holds (a day by the minute): bounds the answer's size
whatever range a caller asks for."""
MIN_STEP_MS: Final = 1_000


class HistoryRangeError(ValueError):
    """A range the history cannot answer (its message names the parameter)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class HistoryRange:
    """``[since_ms, until_ms)`` in buckets of ``step_ms``; the last one may be shorter."""

    since_ms: int
    until_ms: int
    step_ms: int

    def __post_init__(self) -> None:
        if self.step_ms < MIN_STEP_MS:
            raise HistoryRangeError(f"'step_ms' must be at least {MIN_STEP_MS}.", "step_ms")
        if self.until_ms <= self.since_ms:
            raise HistoryRangeError("'until_ms' must be after 'since_ms'.", "until_ms")
        if self.buckets > MAX_BUCKETS:
            raise HistoryRangeError(
                f"The range holds more than {MAX_BUCKETS} steps: widen 'step_ms'.", "step_ms"
            )

    @property
    def buckets(self) -> int:
        return -(-(self.until_ms - self.since_ms) // self.step_ms)

    def bucket_of(self, received_ms: int) -> int | None:
        """The bucket a run received then falls in, ``None`` outside the range (the same
        rule as the query's ``(received_ms - since) / step``)."""
        if not self.since_ms <= received_ms < self.until_ms:
            return None
        return (received_ms - self.since_ms) // self.step_ms

    def length_ms(self, bucket: int) -> int:
        start = self.since_ms + bucket * self.step_ms
        return min(self.step_ms, self.until_ms - start)


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """The runs of one bucket, model and provider, added up (``ttft_sum_ms`` over the
    ``ttft_runs`` runs that had a first token)."""

    bucket: int
    model: str
    provider_id: str
    requests: int = 0
    errors: int = 0
    ttft_sum_ms: int = 0
    ttft_runs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_wait_ms: int = 0

    def plus(self, other: HistoryRow) -> HistoryRow:
        return HistoryRow(
            self.bucket,
            self.model,
            self.provider_id,
            self.requests + other.requests,
            self.errors + other.errors,
            self.ttft_sum_ms + other.ttft_sum_ms,
            self.ttft_runs + other.ttft_runs,
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.queue_wait_ms + other.queue_wait_ms,
        )


def merge_history(rows: Iterable[HistoryRow]) -> list[HistoryRow]:
    """Rows of the same bucket, model and provider added into one, sorted by them."""
    merged: dict[tuple[int, str, str], HistoryRow] = {}
    for row in rows:
        group = (row.bucket, row.model, row.provider_id)
        seen = merged.get(group)
        merged[group] = row if seen is None else seen.plus(row)
    return [merged[group] for group in sorted(merged)]


def series(rows: Iterable[HistoryRow], span: HistoryRange) -> list[dict[str, Any]]:
    """One series per model and provider, each metric a list with one value per bucket
    (``None`` for TTFT where no run had a first token): requests and errors counted,
    mean TTFT in ms, output tokens per second, mean queue depth (Little's law)."""
    by_pair: dict[tuple[str, str], dict[str, list[Any]]] = {}
    n = span.buckets
    for row in rows:
        values = by_pair.get((row.model, row.provider_id))
        if values is None:
            values = {
                "requests": [0] * n,
                "errors": [0] * n,
                "ttft_ms": [None] * n,
                "tokens_per_s": [0.0] * n,
                "queue_depth": [0.0] * n,
            }
            by_pair[(row.model, row.provider_id)] = values
        seconds = span.length_ms(row.bucket) / 1000
        values["requests"][row.bucket] = row.requests
        values["errors"][row.bucket] = row.errors
        if row.ttft_runs:
            values["ttft_ms"][row.bucket] = round(row.ttft_sum_ms / row.ttft_runs, 1)
        values["tokens_per_s"][row.bucket] = round(row.completion_tokens / seconds, 3)
        values["queue_depth"][row.bucket] = round(row.queue_wait_ms / 1000 / seconds, 3)
    return [
        {"model": model, "provider_id": provider_id, **values}
        for (model, provider_id), values in sorted(by_pair.items())
    ]
