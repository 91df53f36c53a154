"""How ``iopctl qualify`` judges answers and compares reports (cli/qualify_checks.py,
cli/qualify_view.py): the schema subset validated, each failure with its reason, and
B's change against A."""

from __future__ import annotations

import json
from typing import Any

from iop_edge.cli.qualify_checks import (
    PERSON_SCHEMA,
    judge_json_schema,
    judge_tool_call,
    schema_errors,
)
from iop_edge.cli.qualify_view import compare_screen, comparison


def answer(content: str | None = None, calls: Any = None, finish: str = "stop") -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return {"choices": [{"message": message, "finish_reason": finish}]}


def call(name: str, arguments: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "arguments": arguments}}]


def test_the_schema_subset() -> None:
    good = {"name": "Ada", "age": 36, "languages": ["en"]}
    assert schema_errors(good, PERSON_SCHEMA) == []
    assert schema_errors({**good, "age": True}, PERSON_SCHEMA) == ["$.age is bool, not integer"]
    assert schema_errors({"name": "Ada", "age": 1, "x": 1}, PERSON_SCHEMA) == [
        "$.languages is missing",
        "$.x is not allowed",
    ]
    assert schema_errors({**good, "languages": [1]}, PERSON_SCHEMA) == [
        "$.languages[0] is int, not string"
    ]


def test_a_tool_call_passes_only_when_well_formed() -> None:
    ok = judge_tool_call(answer(calls=call("get_weather", '{"city":"Paris","unit":"celsius"}')))
    assert (ok.passed, ok.reason) == (True, "")
    text = judge_tool_call(answer("It is sunny."))
    assert not text.passed
    assert "no tool call" in text.reason
    assert "sunny" in text.reason
    other = judge_tool_call(answer(calls=call("get_time", "{}")))
    assert other.reason == "called 'get_time', not 'get_weather'"
    wrong = judge_tool_call(answer(calls=call("get_weather", '{"city":"Paris","unit":"K"}')))
    assert not wrong.passed
    assert "$.unit is 'K'" in wrong.reason
    broken = judge_tool_call(answer(calls=call("get_weather", '{"city":')))
    assert broken.reason.startswith("arguments are not JSON")


def test_a_json_answer_parses_and_validates_or_says_why_not() -> None:
    person = json.dumps({"name": "Ada", "age": 36, "languages": ["en"]})
    assert judge_json_schema(answer(person)).passed
    cut = judge_json_schema(answer('{"name": "Ada", "age"', finish="length"))
    assert cut.reason.startswith("the answer was cut at max_tokens")
    prose = judge_json_schema(answer("Ada is 36."))
    assert prose.reason.startswith("the answer is not JSON")
    invalid = judge_json_schema(answer(json.dumps({"name": "Ada"})))
    assert not invalid.passed
    assert invalid.reason == "$.age is missing; $.languages is missing"


def report(report_id: str, ttft: float, version: str, reached: int) -> dict[str, Any]:
    return {
        "id": report_id,
        "model": "m",
        "node_id": "n",
        "provider_id": "p",
        "engine": {"name": "vllm", "version": version, "device": "cpu"},
        "performance": [
            {
                "concurrency": 1,
                "ttft_p50_ms": ttft,
                "tokens_per_s_single": 50.0,
                "tokens_per_s_aggregate": 40.0,
                "failed": 0,
            },
        ],
        "context": {"reached_tokens": reached},
        "summary": {"tool_call": "fail", "json_schema": "pass", "lifecycle": "pass"},
        "determinism": {"distinct": 1},
    }


def test_a_comparison_gives_b_against_a() -> None:
    before, after = report("qual_a", 200.0, "0.31.0", 1000), report("qual_b", 100.0, "0.32.1", 1000)
    rows = {row["metric"]: row for row in comparison(before, after)}
    assert rows["c=1 ttft p50 ms"] == {
        "metric": "c=1 ttft p50 ms", "a": 200.0, "b": 100.0, "change": "-100 (0.50x)"
    }  # fmt: skip
    assert rows["engine"]["change"] == "changed"
    assert rows["context reached"]["change"] == "+0 (1.00x)"
    assert rows["tool call"]["change"] == "-"
    screen = compare_screen(before, after)
    assert screen.startswith("A = qual_a (m)   B = qual_b (m)")
    assert "vllm 0.31.0" in screen
    assert "vllm 0.32.1" in screen
