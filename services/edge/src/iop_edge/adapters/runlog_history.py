"""The run log's history (``domain.history``), the same on SQLite and PostgreSQL.

One ``GROUP BY`` over the range's rows, read through the ``(received_ms, run_id)`` index
(a range scan: the cost follows the runs in the range, not the table); the bucket is
``(received_ms - since) / step``, integer division on both databases (integers there,
bigints here). As for usage (``runlog_usage``), the records still in the writer's memory
are added up here and left out of the query by run id: each run counted once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from iop_edge.adapters.runlog_usage import ERROR_LIST, latest_versions
from iop_edge.domain.history import HistoryRange, HistoryRow, merge_history
from iop_edge.domain.usage import ERROR_OUTCOMES
from iop_edge.ports import EdgeRunRecord

SUMS = (
    "COUNT(*), "
    f"CAST(SUM(CASE WHEN outcome IN ({ERROR_LIST}) THEN 1 ELSE 0 END) AS BIGINT), "
    "CAST(SUM(ttft_ms) AS BIGINT), "
    "CAST(SUM(CASE WHEN ttft_ms > 0 THEN 1 ELSE 0 END) AS BIGINT), "
    "CAST(SUM(prompt_tokens) AS BIGINT), CAST(SUM(completion_tokens) AS BIGINT), "
    "CAST(SUM(queue_wait_ms) AS BIGINT)"
)
"""The columns after ``bucket, model, provider_id``, in ``HistoryRow``'s order (the
outcomes are constants, never values from a request)."""


def unwritten_in(records: Iterable[EdgeRunRecord], span: HistoryRange) -> list[EdgeRunRecord]:
    """The latest version of each unwritten record received in the range."""
    return [r for r in latest_versions(records) if span.bucket_of(r.received_ms) is not None]


def history_rows(
    stored: Iterable[Any], unwritten: Iterable[EdgeRunRecord], span: HistoryRange
) -> list[HistoryRow]:
    """The query's rows (``bucket, model, provider_id`` and ``SUMS``) and the unwritten
    records, added up by bucket, model and provider."""
    rows = [
        HistoryRow(int(b), str(m), str(p), *(int(v or 0) for v in sums))
        for b, m, p, *sums in stored
    ]
    for r in unwritten:
        bucket = span.bucket_of(r.received_ms)
        if bucket is None:  # outside the range (unwritten_in leaves none)
            continue
        rows.append(
            HistoryRow(
                bucket,
                r.model,
                r.provider_id,
                1,
                1 if r.outcome in ERROR_OUTCOMES else 0,
                r.ttft_ms,
                1 if r.ttft_ms > 0 else 0,
                r.prompt_tokens,
                r.completion_tokens,
                r.queue_wait_ms,
            )
        )
    return merge_history(rows)
