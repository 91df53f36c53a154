"""Limits per key as arithmetic (domain.key_rates) and in this edge's memory
(MemoryKeyRates), driven by a clock the test holds: rates hold over any sliding minute,
a stream that passes the output limit finishes and the next request waits, the budget
stops the key for the rest of its calendar period, and the headers say the same."""

from __future__ import annotations

from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

import pytest

from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.domain.events import Delta
from iop_edge.domain.fleet import NO_LIMITS, ApiKeyEntry, BudgetPeriod, KeyLimits, Operation
from iop_edge.domain.key_rates import (
    BUDGET,
    INPUT,
    OUTPUT,
    REQUESTS,
    period_bounds,
    scopes_of,
)
from iop_edge.domain.usage import Api
from iop_edge.entrypoints.inference_routes import _SseSink
from iop_edge.entrypoints.rate_headers import anthropic_headers, duration, openai_headers
from iop_edge.entrypoints.run_trace import RunTrace
from iop_edge.errors import TooManyConcurrent
from iop_edge.formats.openai import ChunkStream
from iop_edge.service.key_rates import KeyRates, estimate_input_tokens, limited
from iop_edge.service.memory_key_rates import MemoryKeyRates
from iop_proto.v1 import runtime_pb2 as pb

T0 = datetime(2026, 12, 3, 22, 0, 0, tzinfo=UTC).timestamp()  # a Thursday


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def test_requests_per_minute_hold_over_any_sliding_minute() -> None:
    clock = Clock()
    rates = MemoryKeyRates(clock)
    scopes = scopes_of(KeyLimits(requests_per_minute=3), {}, "m")
    admitted = []
    for _ in range(240):  # one attempt every 0.5 s for two minutes
        _, refusal = await rates.admit("k", scopes, 1)
        if refusal is None:
            admitted.append(clock.now)
        clock.now += 0.5
    for start in admitted:  # every minute starting at an admission holds at most 3
        assert sum(1 for t in admitted if start <= t < start + 60) <= 3
    assert len(admitted) == 6  # and the limit is reached: 3 a minute


async def test_a_refusal_says_when_and_takes_nothing() -> None:
    clock = Clock()
    rates = MemoryKeyRates(clock)
    scopes = scopes_of(KeyLimits(requests_per_minute=2, input_tokens_per_minute=100), {}, "m")
    assert (await rates.admit("k", scopes, 10))[1] is None
    clock.now += 20
    assert (await rates.admit("k", scopes, 10))[1] is None
    clock.now += 10
    found, refusal = await rates.admit("k", scopes, 10)
    assert refusal is not None
    assert (refusal.kind, refusal.limit) == (REQUESTS, 2)
    assert refusal.retry_after_s == 31  # the first request leaves the minute then
    shown = {g.kind: g for g in found}
    assert (shown[REQUESTS].remaining, shown[INPUT].remaining) == (0, 80)  # nothing taken


async def test_a_stream_past_the_output_limit_finishes_and_the_next_request_waits() -> None:
    clock = Clock()
    rates = MemoryKeyRates(clock)
    scopes = scopes_of(KeyLimits(output_tokens_per_minute=100), {}, "m")
    for _ in range(3):  # 40 tokens each: the third passes the limit, counted whole
        assert (await rates.admit("k", scopes, 5))[1] is None
        rates.charge("k", scopes, 0, 40)
        clock.now += 1
    found, refusal = await rates.admit("k", scopes, 5)
    assert refusal is not None
    assert refusal.kind == OUTPUT
    assert refusal.retry_after_s == 58  # 61 s after the first stream's tokens
    assert {g.kind: g.remaining for g in found} == {OUTPUT: 0}
    clock.now += 58
    assert (await rates.admit("k", scopes, 5))[1] is None


async def test_the_budget_stops_the_key_until_its_period_ends() -> None:
    clock = Clock()
    rates = MemoryKeyRates(clock)
    limits = KeyLimits(token_budget=100, budget_period=BudgetPeriod.DAY)
    scopes = scopes_of(limits, {}, "m")
    used = 0
    while True:
        _, refusal = await rates.admit("k", scopes, 10)
        if refusal is not None:
            break
        rates.charge("k", scopes, 2, 30)  # the engine said 12 prompt tokens, 30 out
        used += 42
        clock.now += 60
    assert refusal.kind == BUDGET
    assert 100 <= used < 100 + 42  # at most one request past the budget
    assert refusal.retry_after_s == period_bounds(BudgetPeriod.DAY, clock.now)[1] - clock.now
    clock.now = period_bounds(BudgetPeriod.DAY, clock.now)[1]  # the next day
    assert (await rates.admit("k", scopes, 10))[1] is None


def test_periods_are_utc_calendar_days_weeks_and_months() -> None:
    assert period_bounds(BudgetPeriod.DAY, T0) == (
        datetime(2026, 12, 3, tzinfo=UTC).timestamp(),
        datetime(2026, 12, 4, tzinfo=UTC).timestamp(),
    )
    assert period_bounds(BudgetPeriod.WEEK, T0)[0] == datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    assert period_bounds(BudgetPeriod.MONTH, T0) == (
        datetime(2026, 12, 1, tzinfo=UTC).timestamp(),
        datetime(2027, 1, 1, tzinfo=UTC).timestamp(),
    )


async def test_a_model_limit_holds_on_top_of_the_keys() -> None:
    rates = MemoryKeyRates(Clock())
    key = KeyLimits(requests_per_minute=10)
    per_model = {"small": KeyLimits(requests_per_minute=1)}
    assert (await rates.admit("k", scopes_of(key, per_model, "small"), 1))[1] is None
    found, refusal = await rates.admit("k", scopes_of(key, per_model, "small"), 1)
    assert refusal is not None
    assert (refusal.scope, refusal.limit) == ("small", 1)
    assert {g.kind: g.remaining for g in found} == {REQUESTS: 0}  # the tighter of the two
    found, refusal = await rates.admit("k", scopes_of(key, per_model, "large"), 1)
    assert refusal is None
    assert {g.kind: g.remaining for g in found} == {REQUESTS: 8}


async def test_headers_show_the_standing_in_each_apis_words() -> None:
    clock = Clock()
    rates = MemoryKeyRates(clock)
    limits = KeyLimits(requests_per_minute=5, input_tokens_per_minute=1000,
                       output_tokens_per_minute=300, token_budget=5000)  # fmt: skip
    found, _ = await rates.admit("k", scopes_of(limits, {}, "m"), 100)
    openai = openai_headers(found)
    assert openai["x-ratelimit-limit-requests"] == "5"
    assert openai["x-ratelimit-remaining-requests"] == "4"
    assert openai["x-ratelimit-reset-requests"] == "1m1s"
    assert (openai["x-ratelimit-limit-tokens"], openai["x-ratelimit-remaining-tokens"]) == (
        "300",
        "300",
    )  # the output bucket: less left than the input's 900
    assert openai["x-iop-budget-remaining"] == "4900"
    anthropic = anthropic_headers(found, now=T0)
    assert anthropic["anthropic-ratelimit-requests-remaining"] == "4"
    assert anthropic["anthropic-ratelimit-requests-reset"] == "2026-12-03T22:01:01Z"
    assert anthropic["anthropic-ratelimit-input-tokens-remaining"] == "900"
    assert anthropic["anthropic-ratelimit-output-tokens-limit"] == "300"
    assert anthropic["anthropic-ratelimit-tokens-remaining"] == "300"
    assert anthropic["x-iop-budget-reset"] == "2027-01-01T00:00:00Z"


def test_durations_read_as_openais() -> None:
    assert [duration(s) for s in (0.02, 1, 1.5, 360, 3723)] == [
        "20ms",
        "1s",
        "1.5s",
        "6m0s",
        "1h2m3s",
    ]


def test_the_input_estimate_reads_the_prompts_text() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 10**6}
    assert estimate_input_tokens(body) == 101  # the role's 4 letters count too
    assert estimate_input_tokens({"prompt": ""}) == 1


async def test_edges_cut_off_together_each_count_their_share() -> None:
    rates = MemoryKeyRates(Clock(), share=lambda: 2)
    scopes = scopes_of(KeyLimits(requests_per_minute=5), {}, "m")
    results = [(await rates.admit("k", scopes, 1))[1] is None for _ in range(5)]
    assert results == [True, True, False, False, False]  # 5 // 2


def keyed(limits: KeyLimits, **model_limits: KeyLimits) -> ApiKeyEntry:
    return ApiKeyEntry("k", "k", "hash", frozenset(), 0, limits=limits, model_limits=model_limits)


async def test_a_models_max_concurrent_holds_and_is_given_back() -> None:
    rates = KeyRates(MemoryKeyRates(Clock()))
    key = keyed(NO_LIMITS, small=KeyLimits(max_concurrent=1))
    assert limited(key)
    first = await rates.admit(key, "small", {"messages": []})
    with pytest.raises(TooManyConcurrent, match="'small'"):
        await rates.admit(key, "small", {"messages": []})
    other = await rates.admit(key, "large", {"messages": []})  # another model: not held
    await first.close()
    await first.close()  # once
    again = await rates.admit(key, "small", {"messages": []})
    await again.close()
    await other.close()


async def test_a_meter_counts_the_stream_and_corrects_the_estimate_once() -> None:
    clock = Clock()
    store = MemoryKeyRates(clock)
    rates = KeyRates(store)
    key = keyed(KeyLimits(input_tokens_per_minute=1000, output_tokens_per_minute=1000))
    body = {"messages": [{"role": "user", "content": "x" * 396}]}  # 100 tokens, estimated
    meter = await rates.admit(key, "m", body)
    assert meter.refused is None
    for _ in range(40):
        meter.output()
    meter.settle(prompt_tokens=30, completion_tokens=41, ran=True)
    meter.settle(prompt_tokens=30, completion_tokens=41, ran=True)  # once
    await meter.close()
    later = await rates.admit(key, "m", {"messages": []})
    shown = {g.kind: g.remaining for g in later.gauges}
    assert shown == {INPUT: 1000 - 30 - 1, OUTPUT: 1000 - 41}
    never_ran = await rates.admit(key, "m", body)
    never_ran.settle(0, 0, ran=False)  # refused by the queue: the estimate is given back
    assert {g.kind: g.remaining for g in (await rates.admit(key, "m", {})).gauges}[INPUT] == (
        1000 - 30 - 1 - 1  # the first, the later one's estimate, this one's: none of its 100
    )
    assert not limited(keyed(NO_LIMITS))


class Written:
    """A ``StreamOut`` that keeps what the relay writes."""

    def __init__(self) -> None:
        self.prepared = False
        self.headers: MutableMapping[str, str] = {}
        self.data = b""

    async def prepare(self, request: Any) -> None:
        self.prepared = True

    async def write(self, data: bytes) -> None:
        self.data += data

    async def write_eof(self, data: bytes = b"") -> None:
        self.data += data


async def test_a_relayed_stream_counts_each_delta_once_the_first_too() -> None:
    rates = KeyRates(MemoryKeyRates(Clock()))
    key = keyed(KeyLimits(output_tokens_per_minute=1000))
    meter = await rates.admit(key, "m", {"messages": []})
    chat = Operation.CHAT_COMPLETIONS
    writer = ChunkStream(chat, run_id="r", model="m", created=0)
    out = Written()
    request: Any = None  # what ``prepare`` is given: nothing a ``Written`` reads
    sink = _SseSink(request, out, writer, RunTrace(chat, Api.CHAT_COMPLETIONS), meter)
    for text in ("a", "b", "c"):
        write = sink.delta(Delta(text), more=False)
        if write is not None:
            await write
    assert out.prepared
    assert out.data.count(b"data: ") == 3
    meter.settle(prompt_tokens=0, completion_tokens=0, ran=True)  # the deltas stand for it
    await meter.close()
    later = await rates.admit(key, "m", {"messages": []})
    assert {g.kind: g.remaining for g in later.gauges}[OUTPUT] == 1000 - 3


async def test_no_sixty_seconds_hold_more_than_the_limit_across_a_seconds_edge() -> None:
    """A burst at the end of a second, and another 59.01 s later: counted per second,
    the first is still in the minute then (held 60 to 61 s, never less than 60)."""
    clock = Clock()
    rates = MemoryKeyRates(clock)
    scopes = scopes_of(KeyLimits(requests_per_minute=3), {}, "m")
    clock.now = T0 + 0.99
    for _ in range(3):
        assert (await rates.admit("k", scopes, 1))[1] is None
    clock.now = T0 + 60.0
    _, refusal = await rates.admit("k", scopes, 1)
    assert refusal is not None
    assert refusal.retry_after_s == 1.0
    clock.now = T0 + 61.0
    assert (await rates.admit("k", scopes, 1))[1] is None


def test_a_key_sent_without_limits_is_told_unlimited_by_identity() -> None:
    """The hot path's one check for a key without limits (``limited``): the fleet gives
    every such key the one ``NO_LIMITS``."""
    config = pb.FleetConfig(
        api_keys=[
            pb.ApiKeyPolicy(key_id="free", key_hash="a"),
            pb.ApiKeyPolicy(
                key_id="rated", key_hash="b", limits=pb.KeyLimits(requests_per_minute=1)
            ),
        ]
    )
    keys = {k.key_id: k for k in fleet_from_proto(config).api_keys.values()}
    assert keys["free"].limits is NO_LIMITS
    assert not limited(keys["free"])
    assert limited(keys["rated"])
