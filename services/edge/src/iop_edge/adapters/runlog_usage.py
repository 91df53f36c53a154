"""Usage per key from the run log, the same on SQLite and PostgreSQL.

The table is added up by the database (one ``GROUP BY`` over the window's rows, read
through the ``(key_id, received_ms)`` or ``(received_ms)`` index); the records still
in the writer's memory are added up here. A record of that memory may be committed
while the query runs, so the query leaves out every run id the memory holds (taken
before it): each run is counted once, from its latest version.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from iop_edge.domain.usage import ERROR_OUTCOMES, UsageRow, merge_rows
from iop_edge.ports import EdgeRunRecord

ERROR_LIST = ", ".join(f"'{o}'" for o in ERROR_OUTCOMES)
"""The error outcomes as an SQL list (this module's constants, never a request's values),
for the usage and the history queries alike."""
SUMS = (
    "COUNT(*), "
    f"CAST(SUM(CASE WHEN outcome IN ({ERROR_LIST}) THEN 1 ELSE 0 END) AS BIGINT), "
    "CAST(SUM(prompt_tokens) AS BIGINT), CAST(SUM(completion_tokens) AS BIGINT)"
)
"""The columns after ``key_id, model, api``, in ``UsageRow``'s order, on both databases
(the cast: PostgreSQL's SUM of bigint is numeric). The outcomes are this module's
constants, never values from a request."""


def latest_versions(records: Iterable[EdgeRunRecord]) -> list[EdgeRunRecord]:
    """The latest version of each of the writer's unwritten records, one per run."""
    latest: dict[str, EdgeRunRecord] = {}
    for record in records:  # oldest first: a later version replaces an earlier one
        latest[record.run_id] = record
    return list(latest.values())


def in_window(
    records: Iterable[EdgeRunRecord], since_ms: int, key_id: str | None
) -> list[EdgeRunRecord]:
    """The latest version of each unwritten record of the window (and of ``key_id``)."""
    return [
        r
        for r in latest_versions(records)
        if r.received_ms >= since_ms and (key_id is None or r.key_id == key_id)
    ]


def usage_rows(stored: Iterable[Any], unwritten: Iterable[EdgeRunRecord]) -> list[UsageRow]:
    """The query's rows (``key_id, model, api`` and ``SUMS``) and the unwritten records,
    added up by key, model and API."""
    rows = [
        UsageRow(str(k), str(m), str(a), int(n), int(e or 0), int(i or 0), int(o or 0))
        for k, m, a, n, e, i, o in stored
    ]
    rows.extend(
        UsageRow(
            r.key_id,
            r.model,
            r.api,
            1,
            1 if r.outcome in ERROR_OUTCOMES else 0,
            r.prompt_tokens,
            r.completion_tokens,
        )
        for r in unwritten
    )
    return merge_rows(rows)
