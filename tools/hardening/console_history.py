"""Issue 33, the console's history: what the run log's history costs on a large log, on
the checkout the venv imports (``PYTHONPATH`` of another checkout's ``src`` folders
measures that one): the same script before and after.

A SQLite run log of ``--rows`` runs spread over ``--days`` days (three models, two
providers each), then the console's query, the trailing 15 minutes in 10 s steps,
timed (the median of ``--repeat``): through ``RunLog.history`` where the checkout has
it, and the same ``GROUP BY`` forced past the index (``NOT INDEXED``), as a query
without a usable index would run. Printed: the rows the range holds, both times, the plan.

    PYTHONPATH=CHECKOUT/proto/src:CHECKOUT/services/edge/src \\
        .venv/bin/python tools/hardening/console_history.py [--rows 1000000] [--days 7]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from iop_edge.adapters import sqlite_runlog
from iop_edge.adapters.sqlite_runlog import SqliteRunLog
from iop_edge.ports import EdgeRunRecord

RANGE_MS = 15 * 60_000
STEP_MS = 10_000


def fill(path: Path, rows: int, days: int, now_ms: int) -> None:
    """``rows`` runs, evenly over the ``days`` before ``now_ms``, in one transaction."""
    span = days * 86_400_000
    columns = sqlite_runlog.COLUMNS
    insert = f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"

    def row(n: int) -> tuple[object, ...]:
        record = EdgeRunRecord(
            f"run-{n:09d}", f"model-{n % 3}", f"provider-{n % 6}", "node-a",
            "chat_completions", True, "failed" if n % 50 == 0 else "completed", 200,
            received_ms=now_ms - span + n * span // rows, queue_wait_ms=n % 700,
            ttft_ms=40 + n % 300, duration_ms=900, prompt_tokens=30, completion_tokens=120,
            key_id="key_1", api="chat_completions",
        )  # fmt: skip
        return sqlite_runlog.run_row(record)

    db = sqlite3.connect(path)
    try:
        with db:
            db.executemany(insert, (row(n) for n in range(rows)))
    finally:
        db.close()


def timed_scan(path: Path, since: int, until: int, repeat: int) -> float:
    """The console's GROUP BY with the index forbidden: the table read whole."""
    query = (
        "SELECT (received_ms - ?) / ?, model, provider_id, COUNT(*), SUM(ttft_ms),"
        " SUM(completion_tokens), SUM(queue_wait_ms) FROM runs NOT INDEXED"
        " WHERE received_ms >= ? AND received_ms < ? GROUP BY 1, 2, 3"
    )
    db = sqlite3.connect(path)
    try:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            db.execute(query, (since, STEP_MS, since, until)).fetchall()
            times.append(time.perf_counter() - started)
    finally:
        db.close()
    return statistics.median(times) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    now_ms = int(time.time() * 1000)
    since, until = now_ms - RANGE_MS, now_ms
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "runs.db"
        log = await SqliteRunLog.open(path)  # the checkout's schema and indexes
        await log.aclose()
        started = time.perf_counter()
        fill(path, args.rows, args.days, now_ms)
        wrote = time.perf_counter() - started
        print(f"run log: {args.rows} runs over {args.days} days ({wrote:.1f} s to write)")
        in_range = (
            sqlite3.connect(path)
            .execute(
                "SELECT COUNT(*) FROM runs WHERE received_ms >= ? AND received_ms < ?",
                (since, until),
            )
            .fetchone()[0]
        )
        print(f"the console's range (15 min, 10 s steps): {in_range} runs")
        scan_ms = timed_scan(path, since, until, args.repeat)
        print(f"full-table GROUP BY (NOT INDEXED): {scan_ms:.1f} ms")
        log = await SqliteRunLog.open(path)
        try:
            if not hasattr(log, "history"):
                print("RunLog.history: absent on this checkout (no GET /iop/v1/history, no plots)")
                return
            from iop_edge.domain.history import HistoryRange

            span = HistoryRange(since, until, STEP_MS)
            times = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                rows = await log.history(span)
                times.append(time.perf_counter() - started)
            print(
                f"RunLog.history (index range): {statistics.median(times) * 1000:.1f} ms,"
                f" {len(rows)} rows, {sum(r.requests for r in rows)} runs"
            )
            plan = (
                sqlite3.connect(path)
                .execute(
                    "EXPLAIN QUERY PLAN " + sqlite_runlog.HISTORY_QUERY,
                    (since, STEP_MS, since, until, "[]"),
                )
                .fetchall()
            )
            print("plan:", " | ".join(str(step[-1]) for step in plan))
        finally:
            await log.aclose()


if __name__ == "__main__":
    asyncio.run(main())
