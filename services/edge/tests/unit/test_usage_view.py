"""``iopctl usage``'s tables from what ``GET /iop/v1/usage`` answers: each cell of use
against its limit, a limit of 0 shown as unlimited, the split by API."""

from __future__ import annotations

from typing import Any

from iop_edge.cli.iopctl import table
from iop_edge.cli.usage_view import against, usage_screen


def counts(requests: int, tokens_in: int, tokens_out: int, errors: int = 0) -> dict[str, int]:
    return {
        "requests": requests,
        "errors": errors,
        "input_tokens": tokens_in,
        "output_tokens": tokens_out,
        "tokens": tokens_in + tokens_out,
    }


def window(by_api: dict[str, dict[str, int]], **extra: Any) -> dict[str, Any]:
    total = {name: sum(c[name] for c in by_api.values()) for name in counts(0, 0, 0)}
    return {"since_ms": 0, **total, "by_api": by_api, "by_model": {}, **extra}


LIMITS = {
    "requests_per_minute": 10,
    "input_tokens_per_minute": 0,
    "output_tokens_per_minute": 500,
    "token_budget": 10_000,
    "budget_period": "week",
    "max_concurrent": 0,
}


def test_use_against_limits_and_by_api() -> None:
    minute = {"chat_completions": counts(2, 20, 8)}
    day = {"chat_completions": counts(5, 50, 20, errors=1), "batch": counts(3, 30, 9)}
    alice = {
        "key_id": "key_a",
        "name": "alice",
        "in_fleet": True,
        "operator": False,
        "in_flight": 1,
        "max_concurrent": 4,
        "limits": LIMITS,
        "minute": window(minute),
        "day": window(day),
        "period": window(day, period="week"),
        "models": [
            {
                "model": "qwen",
                "limits": {**LIMITS, "requests_per_minute": 0, "budget_period": "month"},
                "minute": counts(1, 5, 5),
                "period": {**counts(4, 40, 40), "period": "month"},
            }
        ],
    }
    gone = {
        **alice,
        "key_id": "key_x",
        "name": "",
        "in_fleet": False,
        "limits": None,
        "max_concurrent": 0,
        "models": [],
    }
    keys, models, apis = (t.splitlines() for t in usage_screen([alice, gone], table).split("\n\n"))
    assert keys[0].split() == [
        "KEY", "NAME", "REQ/MIN", "IN_TOK/MIN", "OUT_TOK/MIN", "IN_FLIGHT", "REQ_TODAY",
        "TOK_TODAY", "ERR_TODAY", "BUDGET",
    ]  # fmt: skip
    assert keys[1].split() == [
        "key_a", "alice", "2/10", "20/unlimited", "8/500", "1/4", "8", "109", "1",
        "109/10000", "(week)",
    ]  # fmt: skip
    assert keys[2].split()[:6] == ["key_x", "(not", "in", "the", "fleet)", "2/unlimited"]
    assert models[1].split() == [
        "key_a", "qwen", "1/unlimited", "5/unlimited", "5/500", "80/10000", "(month)",
    ]  # fmt: skip
    assert [line.split()[:4] for line in apis[1:3]] == [
        ["key_a", "batch", "0", "3"],
        ["key_a", "chat_completions", "2", "5"],
    ]


def test_a_zero_limit_is_unlimited() -> None:
    assert (against(3, 0), against(3, 5)) == ("3/unlimited", "3/5")
