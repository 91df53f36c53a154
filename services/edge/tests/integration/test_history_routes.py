"""``GET /iop/v1/history`` over real TCP, behind the API's own gate, on a real SQLite run
log: operators only, the range's parameters checked, the series the run log holds."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop_edge.adapters.sqlite_runlog import SqliteRunLog
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_gate import ApiGate
from iop_edge.entrypoints.history_routes import HistoryRoutes
from iop_edge.ports import EdgeRunRecord
from iop_edge.service.history import DEFAULT_RANGE_MS, DEFAULT_STEP_MS, HistoryReport

NOW_MS = 1_740_830_405_000  # 2025-03-01 12:00:05 UTC
OPS = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True)
ALICE = ApiKeyEntry("key_a", "alice", "hash-a", frozenset(), 0)


@dataclass
class FakeKeys:
    by_key: dict[str, ApiKeyEntry] | None  # None: no keys configured (the open API)

    configured = True  # a fleet config has arrived

    @property
    def open(self) -> bool:
        return self.by_key is None

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return (self.by_key or {}).get(presented_key)


@contextlib.asynccontextmanager
async def serve(runlog: SqliteRunLog, keys: FakeKeys) -> AsyncIterator[str]:
    app = web.Application(middlewares=[ApiGate(keys).middleware()])
    HistoryRoutes(HistoryReport(runlog, lambda: NOW_MS / 1000), keys).register(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/iop/v1/history"
    finally:
        await runner.cleanup()


@pytest.fixture
async def runlog(tmp_path: Path) -> AsyncIterator[SqliteRunLog]:
    opened = await SqliteRunLog.open(tmp_path / "runs.db")
    try:
        yield opened
    finally:
        await opened.aclose()


def ran(run_id: str, at_ms: int, provider_id: str = "p1") -> EdgeRunRecord:
    return EdgeRunRecord(
        run_id, "llama3", provider_id, "n1", "chat_completions", True, "completed", 200,
        received_ms=at_ms, ttft_ms=50, completion_tokens=20, queue_wait_ms=2_000,
    )  # fmt: skip


async def get(url: str, key: str | None = None, **params: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers, params=params) as response:
            return response.status, await response.json()


async def test_an_operator_gets_the_series_and_other_keys_are_refused(
    runlog: SqliteRunLog,
) -> None:
    runlog.record(ran("r1", NOW_MS - 1_000))
    runlog.record(ran("r2", NOW_MS - 2_000, provider_id="p2"))
    runlog.record(ran("old", NOW_MS - DEFAULT_RANGE_MS - 60_000))  # before the default range
    keys = FakeKeys({"sk-ops": OPS, "sk-alice": ALICE})
    async with serve(runlog, keys) as url:
        status, body = await get(url)
        assert (status, body["error"]["message"].startswith("You didn't provide")) == (401, True)
        status, body = await get(url, "sk-alice")
        assert (status, body["error"]["code"]) == (403, "operator_only")
        status, body = await get(url, "sk-ops")
        assert status == 200, body
        # The default: the trailing 15 minutes in 10 s steps, starting on a step.
        assert body["step_ms"] == DEFAULT_STEP_MS
        assert body["until_ms"] == NOW_MS + 1
        assert body["since_ms"] % DEFAULT_STEP_MS == 0
        assert body["buckets"] == DEFAULT_RANGE_MS // DEFAULT_STEP_MS
        assert [(s["model"], s["provider_id"]) for s in body["data"]] == [
            ("llama3", "p1"),
            ("llama3", "p2"),
        ]
        p1 = body["data"][0]
        assert len(p1["requests"]) == body["buckets"]
        assert sum(p1["requests"]) == 1
        assert p1["requests"][-1] == 1  # received a second ago: the last step
        assert p1["ttft_ms"][-1] == 50
        assert p1["ttft_ms"][0] is None
        # An explicit range, wider steps: both runs in one step of a minute.
        status, body = await get(
            url, "sk-ops", since_ms=NOW_MS - 60_000, until_ms=NOW_MS, step_ms=60_000
        )
        assert status == 200, body
        assert [s["requests"] for s in body["data"]] == [[1], [1]]
        assert [s["queue_depth"] for s in body["data"]] == [[round(2 / 60, 3)]] * 2


async def test_the_open_api_serves_it_and_bad_ranges_are_400s(runlog: SqliteRunLog) -> None:
    async with serve(runlog, FakeKeys(None)) as url:
        status, body = await get(url)
        assert (status, body["data"]) == (200, [])
        for params, param in (
            ({"step_ms": "ten"}, "step_ms"),
            ({"since_ms": "1.5"}, "since_ms"),
            ({"step_ms": 10}, "step_ms"),
            ({"step_ms": 0}, "step_ms"),  # no default range laid on a zero step
            ({"since_ms": -1}, "since_ms"),
            ({"until_ms": 2**64}, "until_ms"),  # beyond the stores' integers
            ({"since_ms": NOW_MS, "until_ms": NOW_MS - 1}, "until_ms"),
            ({"since_ms": 0, "until_ms": NOW_MS, "step_ms": 1_000}, "step_ms"),
        ):
            status, body = await get(url, **params)
            assert (status, body["error"]["param"]) == (400, param), params
