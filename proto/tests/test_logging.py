"""Logging: an unexpected error is logged once, and a pathological one stays small."""

from __future__ import annotations

import pytest
from loguru import logger

from iop_proto.service.logging import MAX_TRACEBACK_CHARS, bounded_traceback, log_unexpected


def _recurse(n: int) -> None:
    if n == 0:
        raise ValueError("x" * 100_000)  # a message quoting a whole body
    _recurse(n - 1)


def _pathological() -> BaseException:
    try:
        try:
            _recurse(400)
        except ValueError as exc:
            raise RuntimeError("while handling it") from exc
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_a_short_traceback_is_kept_whole() -> None:
    try:
        raise KeyError("k")
    except KeyError as exc:
        text = bounded_traceback(exc)
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith("KeyError: 'k'")
    assert "characters cut" not in text


def test_a_pathological_traceback_is_cut_keeping_its_start_and_end() -> None:
    text = bounded_traceback(_pathological())
    assert len(text) < MAX_TRACEBACK_CHARS + 100
    assert text.startswith("Traceback (most recent call last):")
    assert "characters cut" in text
    assert text.endswith("RuntimeError: while handling it")


def test_log_unexpected_writes_one_bounded_record(capsys: pytest.CaptureFixture[str]) -> None:
    records: list[str] = []
    sink = logger.add(records.append, format="{message}", level="ERROR")
    try:
        log_unexpected(_pathological(), "serving {} {{literal}}", "POST /v1/x")
    finally:
        logger.remove(sink)
    [record] = records
    assert record.startswith("serving POST /v1/x {literal}\nTraceback")
    assert len(record) < MAX_TRACEBACK_CHARS + 200
