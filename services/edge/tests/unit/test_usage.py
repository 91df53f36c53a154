"""``UsageReport`` over a real SQLite run log: each key's usage in its limits' windows,
and who may see whose."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from iop_edge.adapters.sqlite_runlog import SqliteRunLog
from iop_edge.domain.fleet import ApiKeyEntry, BudgetPeriod, Fleet, KeyLimits
from iop_edge.domain.usage import period_start_ms
from iop_edge.errors import NotFound
from iop_edge.ports import EdgeRunRecord
from iop_edge.service.usage import UsageReport

# Wednesday 2025-03-12 12:00:30 UTC: the week began on Monday the 10th, the month on the 1st.
NOW = datetime.datetime(2025, 3, 12, 12, 0, 30, tzinfo=datetime.UTC).timestamp()
NOW_MS = int(NOW * 1000)
DAY_MS = 86_400_000

ALICE = ApiKeyEntry(
    "key_a",
    "alice",
    "hash-a",
    frozenset(),
    4,
    limits=KeyLimits(requests_per_minute=10, token_budget=1000, budget_period=BudgetPeriod.WEEK),
    model_limits={"qwen": KeyLimits(output_tokens_per_minute=50, budget_period=BudgetPeriod.MONTH)},
)
BOB = ApiKeyEntry("key_b", "bob", "hash-b", frozenset(), 0)  # no limits at all
OPS = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True)


@dataclasses.dataclass
class Holder:
    current: Fleet


def ran(
    n: int, key_id: str, api: str, ago_ms: int, model: str = "llama", outcome: str = "completed"
) -> EdgeRunRecord:
    return EdgeRunRecord(
        run_id=f"r{n}",
        model=model,
        provider_id="p1",
        node_id="n1",
        operation="chat_completions",
        stream=False,
        outcome=outcome,
        status=200 if outcome == "completed" else 502,
        received_ms=NOW_MS - ago_ms,
        prompt_tokens=10,
        completion_tokens=5,
        key_id=key_id,
        api=api,
    )


@pytest.fixture
async def runlog(tmp_path: Path) -> AsyncIterator[SqliteRunLog]:
    opened = await SqliteRunLog.open(tmp_path / "runs.db")
    try:
        yield opened
    finally:
        await opened.aclose()


@pytest.fixture
def report(runlog: SqliteRunLog) -> UsageReport:
    fleet = Fleet(api_keys={k.key_hash: k for k in (ALICE, BOB, OPS)})
    in_flight = {"key_a": 2}
    return UsageReport(Holder(fleet), runlog, lambda key_id: in_flight.get(key_id, 0), lambda: NOW)


def test_periods_are_calendar_periods_in_utc() -> None:
    day = datetime.datetime(2025, 3, 12, tzinfo=datetime.UTC).timestamp() * 1000
    assert period_start_ms(BudgetPeriod.DAY, NOW_MS) == day
    assert period_start_ms(BudgetPeriod.WEEK, NOW_MS) == day - 2 * DAY_MS  # Monday
    assert period_start_ms(BudgetPeriod.MONTH, NOW_MS) == day - 11 * DAY_MS
    assert period_start_ms(None, NOW_MS) == NOW_MS - 60_000


async def test_each_key_s_usage_in_its_windows_beside_its_limits(
    report: UsageReport, runlog: SqliteRunLog
) -> None:
    runlog.record(ran(1, "key_a", "chat_completions", 1_000))  # this minute
    runlog.record(ran(2, "key_a", "messages", 2_000, outcome="failed"))  # this minute
    runlog.record(ran(3, "key_a", "batch", 120_000, model="qwen"))  # today
    runlog.record(ran(4, "key_a", "responses", DAY_MS))  # yesterday: this week
    runlog.record(ran(5, "key_a", "responses", 3 * DAY_MS, model="qwen"))  # last week: month
    runlog.record(ran(6, "key_b", "completions", 1_000))
    runlog.record(ran(7, "gone", "embeddings", 1_000))  # a key since revoked
    await runlog.flush()

    report_all = await report.views(OPS)
    assert report_all["now_ms"] == NOW_MS
    by_id = {view["key_id"]: view for view in report_all["data"]}
    assert list(by_id) == ["key_a", "key_b", "key_op", "gone"]  # the fleet's by name, then others
    alice = by_id["key_a"]
    assert (alice["name"], alice["in_fleet"], alice["in_flight"], alice["max_concurrent"]) == (
        "alice",
        True,
        2,
        4,
    )
    assert alice["limits"]["requests_per_minute"] == 10
    assert alice["limits"]["budget_period"] == "week"
    minute = alice["minute"]
    assert (minute["requests"], minute["errors"], minute["input_tokens"]) == (2, 1, 20)
    assert minute["by_api"] == {
        "chat_completions": {
            "requests": 1,
            "errors": 0,
            "input_tokens": 10,
            "output_tokens": 5,
            "tokens": 15,
        },
        "messages": {
            "requests": 1,
            "errors": 1,
            "input_tokens": 10,
            "output_tokens": 5,
            "tokens": 15,
        },
    }
    assert alice["day"]["requests"] == 3
    assert alice["day"]["by_api"]["batch"]["requests"] == 1
    assert (alice["period"]["period"], alice["period"]["requests"], alice["period"]["tokens"]) == (
        "week",
        4,
        60,
    )
    assert alice["period"]["since_ms"] == period_start_ms(BudgetPeriod.WEEK, NOW_MS)
    (qwen,) = alice["models"]
    assert (qwen["model"], qwen["limits"]["output_tokens_per_minute"]) == ("qwen", 50)
    assert qwen["minute"]["requests"] == 0
    assert (qwen["period"]["period"], qwen["period"]["requests"]) == ("month", 2)
    bob = by_id["key_b"]
    assert bob["limits"] == dataclasses.asdict(KeyLimits()) | {"budget_period": "month"}
    assert (bob["minute"]["requests"], bob["period"]["period"], bob["models"]) == (1, "month", [])
    assert by_id["key_op"]["day"]["requests"] == 0
    gone = by_id["gone"]
    assert (gone["in_fleet"], gone["limits"], gone["minute"]["requests"]) == (False, None, 1)


async def test_a_key_sees_only_its_own_usage_and_an_operator_any_one(
    report: UsageReport, runlog: SqliteRunLog
) -> None:
    runlog.record(ran(1, "key_a", "chat_completions", 1_000))
    runlog.record(ran(2, "key_b", "completions", 1_000))  # unwritten: counted all the same

    own = await report.views(BOB)
    assert [(v["key_id"], v["minute"]["requests"]) for v in own["data"]] == [("key_b", 1)]
    assert [v["key_id"] for v in (await report.views(BOB, "bob"))["data"]] == ["key_b"]
    for other in ("key_a", "alice", "nobody"):
        with pytest.raises(NotFound):
            await report.views(BOB, other)
    for asked in ("key_a", "alice"):
        (alice,) = (await report.views(OPS, asked))["data"]
        assert (alice["key_id"], alice["minute"]["requests"]) == ("key_a", 1)
    with pytest.raises(NotFound):
        await report.views(OPS, "nobody")
    # The open API (no keys) is an operator's view.
    assert {v["key_id"] for v in (await report.views(None))["data"]} == {"key_a", "key_b", "key_op"}
