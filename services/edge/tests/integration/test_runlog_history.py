"""The run log's history (``RunLog.history``) against real databases: the same contract
on a SQLite file and on a real PostgreSQL, and each one's plan reads the range through
the ``received_ms`` index."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from iop_edge.adapters import postgres_runlog, sqlite_runlog
from iop_edge.adapters.postgres_runlog import PostgresRunLog
from iop_edge.adapters.sqlite_runlog import SqliteRunLog
from iop_edge.domain.history import HistoryRange, HistoryRangeError, HistoryRow, series
from iop_edge.ports import EdgeRunRecord

T0 = 1_740_830_400_000  # 2025-03-01 12:00 UTC in Unix milliseconds
STEP = 10_000
SPAN = HistoryRange(T0, T0 + 3 * STEP, STEP)

Log = SqliteRunLog | PostgresRunLog


def ran(
    run_id: str,
    at_ms: int,
    provider_id: str = "p1",
    model: str = "llama3",
    outcome: str = "completed",
    **more: int,
) -> EdgeRunRecord:
    values = {
        "queue_wait_ms": 500,
        "ttft_ms": 40,
        "prompt_tokens": 12,
        "completion_tokens": 30,
        **more,
    }
    return EdgeRunRecord(
        run_id=run_id,
        model=model,
        provider_id=provider_id,
        node_id="node-a",
        operation="chat_completions",
        stream=True,
        outcome=outcome,
        status=200 if outcome == "completed" else 502,
        received_ms=at_ms,
        key_id="key_1",
        api="chat_completions",
        **values,
    )


@pytest.fixture(params=["sqlite", "postgres"])
async def runlog(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Log]:
    """The contract's tests run on both; ``postgres`` on a fresh database of a real server."""
    if request.param == "sqlite":
        opened: Log = await SqliteRunLog.open(tmp_path / "runs.db")
        try:
            yield opened
        finally:
            await opened.aclose()
        return
    pool = await asyncpg.create_pool(
        request.getfixturevalue("postgres_dsn"), min_size=1, max_size=2, timeout=5
    )
    assert pool is not None
    try:
        opened = await PostgresRunLog.open(pool)
        try:
            yield opened
        finally:
            await opened.aclose()
    finally:
        await pool.close()


async def test_history_adds_up_runs_by_step_model_and_provider(runlog: Log) -> None:
    runlog.record(ran("before", T0 - 1))  # outside the range, each side
    runlog.record(ran("after", T0 + 3 * STEP))
    runlog.record(ran("a1", T0))
    runlog.record(ran("a2", T0 + STEP - 1, outcome="failed", ttft_ms=0, completion_tokens=0))
    runlog.record(ran("a3", T0 + STEP, ttft_ms=60, queue_wait_ms=4_000))
    runlog.record(ran("b1", T0 + 2 * STEP + 5, provider_id="p2", outcome="rejected"))
    runlog.record(ran("q1", T0 + 1, model="qwen", provider_id=""))
    await runlog.flush()
    # In memory only: a new run, and a new version of one already written (counted once).
    runlog.record(ran("a4", T0 + 2 * STEP, ttft_ms=20))
    runlog.record(ran("a1", T0, completion_tokens=100))

    expected = [
        HistoryRow(0, "llama3", "p1", 2, 1, 40, 1, 24, 100, 1_000),
        HistoryRow(0, "qwen", "", 1, 0, 40, 1, 12, 30, 500),
        HistoryRow(1, "llama3", "p1", 1, 0, 60, 1, 12, 30, 4_000),
        HistoryRow(2, "llama3", "p1", 1, 0, 20, 1, 12, 30, 500),
        HistoryRow(2, "llama3", "p2", 1, 1, 40, 1, 12, 30, 500),
    ]
    assert await runlog.history(SPAN) == expected
    # Once all is written the rows are the same: nothing counted twice, nothing lost.
    await runlog.flush()
    assert await runlog.history(SPAN) == expected
    # Another range and step: one bucket of 30 s holds every run of the three.
    wide = HistoryRange(T0, T0 + 3 * STEP, 3 * STEP)
    assert [(r.bucket, r.model, r.provider_id, r.requests) for r in await runlog.history(wide)] == [
        (0, "llama3", "p1", 4),
        (0, "llama3", "p2", 1),
        (0, "qwen", "", 1),
    ]
    assert await runlog.history(HistoryRange(T0 - 60_000, T0 - 1, STEP)) == []

    plotted = {(s["model"], s["provider_id"]): s for s in series(expected, SPAN)}
    p1 = plotted[("llama3", "p1")]
    assert p1["requests"] == [2, 1, 1]
    assert p1["errors"] == [1, 0, 0]
    assert p1["ttft_ms"] == [40.0, 60.0, 20.0]  # the mean of the runs that had a first token
    assert p1["tokens_per_s"] == [10.0, 3.0, 3.0]  # output tokens over the step's 10 s
    assert p1["queue_depth"] == [0.1, 0.4, 0.05]  # 1 s, 4 s, 0.5 s queued in 10 s
    assert plotted[("llama3", "p2")]["ttft_ms"] == [None, None, 40.0]  # no run, no TTFT


async def test_the_range_is_read_through_the_received_index(runlog: Log, tmp_path: Path) -> None:
    """The plan of the adapter's own query: a range search on ``received_ms``, never a
    scan of the whole table."""
    for n in range(200):
        runlog.record(ran(f"r{n}", T0 - 500_000 + n * 5_000, provider_id=f"p{n % 3}"))
    await runlog.flush()
    assert len(await runlog.history(SPAN)) > 0
    if isinstance(runlog, SqliteRunLog):
        raw = sqlite3.connect(tmp_path / "runs.db")
        try:
            plan = raw.execute(
                "EXPLAIN QUERY PLAN " + sqlite_runlog.HISTORY_QUERY,
                (T0, STEP, T0, T0 + 3 * STEP, "[]"),
            ).fetchall()
        finally:
            raw.close()
        details = " ".join(str(row[-1]) for row in plan)
        assert "USING INDEX runs_received (received_ms>? AND received_ms<?)" in details, details
    else:
        async with runlog._pool.acquire() as connection:
            await connection.execute("ANALYZE edge_runs")
            # A table of 200 rows is cheaper to scan than to search: forbid the scan, so
            # the plan says whether the index can serve the query's range at all.
            await connection.execute("SET enable_seqscan = off")
            plan = await connection.fetch(
                "EXPLAIN " + postgres_runlog.HISTORY_QUERY, T0, STEP, T0 + 3 * STEP, []
            )
            await connection.execute("RESET enable_seqscan")
        text = "\n".join(row[0] for row in plan)
        assert "edge_runs_received" in text, text
        assert "Seq Scan" not in text, text


def test_a_range_that_cannot_be_answered_is_refused_naming_its_parameter() -> None:
    for since, until, step, param in (
        (T0, T0, STEP, "until_ms"),
        (T0, T0 + STEP, 999, "step_ms"),
        (T0, T0 + 1_441 * 1_000, 1_000, "step_ms"),
    ):
        with pytest.raises(HistoryRangeError) as refused:
            HistoryRange(since, until, step)
        assert refused.value.param == param
    # The last bucket may be shorter: its rate is over its own length.
    short = HistoryRange(T0, T0 + STEP + 2_000, STEP)
    assert short.buckets == 2
    (plotted,) = series([HistoryRow(1, "m", "p", 1, 0, 0, 0, 0, 10, 1_000)], short)
    assert plotted["tokens_per_s"] == [0.0, 5.0]
    assert plotted["queue_depth"] == [0.0, 0.5]
