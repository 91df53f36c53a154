"""Validating a batch input file from an iterator of lines: OpenAI's rules, bounded reports."""

from __future__ import annotations

import json
from collections.abc import Iterator

from iop_edge.domain.batches import (
    MAX_REPORTED_ERRORS,
    MAX_REQUESTS,
    check_input,
    input_lines,
)

CHAT = "/v1/chat/completions"
LIMIT = 1024 * 1024  # a body limit no line here reaches, but for the oversize test


def line(custom_id: str, model: object = "m") -> bytes:
    body = {"model": model, "messages": []}
    request = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}
    return json.dumps(request).encode() + b"\n"


def once(lines: list[bytes]) -> Iterator[bytes]:
    """An iterator that can be read only once, as a file being read is."""
    yield from lines


def test_a_valid_file_is_counted_and_read_again_line_by_line() -> None:
    lines = [line("a"), b"\n", line("b", model="other"), line("c", model=7)]
    check = check_input(once(lines), CHAT, LIMIT)
    assert (check.total, check.errors) == (3, [])
    assert check.models == {"m": [0], "other": [1]}  # a non-string model is not a model
    requests = list(input_lines(once(lines), CHAT))
    assert [(r.index, r.custom_id, r.model) for r in requests] == [
        (0, "a", "m"),
        (1, "b", "other"),
        (2, "c", None),
    ]
    assert json.loads(requests[0].body_json) == {"model": "m", "messages": []}


def test_errors_past_the_reported_limit_are_counted_not_kept() -> None:
    bad = [b"not json\n"] * (MAX_REPORTED_ERRORS + 5)
    check = check_input(once([line("ok"), *bad]), CHAT, LIMIT)
    assert len(check.errors) == MAX_REPORTED_ERRORS + 1
    assert check.errors[0]["line"] == 2
    assert check.errors[-1]["code"] == "too_many_errors"
    assert check.errors[-1]["message"] == "5 more errors were not listed."


def test_too_many_requests_comes_first_and_the_report_stays_bounded() -> None:
    many = [line(f"r{n}") for n in range(MAX_REQUESTS + 1)]
    check = check_input(once(many), CHAT, LIMIT)
    assert [e["code"] for e in check.errors] == ["too_many_requests"]
    bad = [b"[]\n"] * (MAX_REPORTED_ERRORS + 5)
    check = check_input(once(many[:MAX_REQUESTS] + bad), CHAT, LIMIT)
    codes = [e["code"] for e in check.errors]
    assert len(codes) == MAX_REPORTED_ERRORS + 1
    assert (codes[0], codes[1], codes[-1]) == (
        "too_many_requests",
        "invalid_json_line",
        "too_many_errors",
    )
    assert check.errors[-1]["message"] == "6 more errors were not listed."


def test_an_empty_file_is_an_error() -> None:
    assert [e["code"] for e in check_input(once([b"\n", b"  \n"]), CHAT, LIMIT).errors] == [
        "empty_file"
    ]


def test_a_body_over_the_limit_is_noted_by_index_and_still_counted() -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 300}]}
    request = {"custom_id": "big", "method": "POST", "url": CHAT, "body": big}
    lines = [line("a"), json.dumps(request).encode() + b"\n", line("c")]
    check = check_input(once(lines), CHAT, 200)
    assert (check.total, check.errors, check.oversize) == (3, [], [1])
    # the limit is the body's, as stored: a line just over it whose body fits is not noted
    fits = len(json.dumps(big, separators=(",", ":")).encode())
    assert check_input(once(lines), CHAT, fits).oversize == []
    assert check_input(once(lines), CHAT, fits - 1).oversize == [1]
