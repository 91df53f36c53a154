"""Logging: an unexpected error is logged once, and a pathological one stays small; no secret
leaves in a line, and the standard library's records come through loguru."""

from __future__ import annotations

import io
import logging

import pytest
from aiohttp.http_exceptions import BadStatusLine
from loguru import logger

from iop_proto.service.logging import MAX_TRACEBACK_CHARS, bounded_traceback, log_unexpected
from iop_proto.service.redaction import REDACTED, RedactingStream, redact
from iop_proto.service.stdlib_bridge import LoguruBridge


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


# --- secrets and the standard library's records -------------------------------------------

KEY = "sk-iop-cVywVThzUDduEVQXo0H2U4Ffiexg0zJCeEm1m_e9FkQ"
TOKEN = "iopnt_Zq1Yd4nQ2w8Kk3mP0aVbX7rT5sU9cE6fG1hJ2iL4oN8"


@pytest.mark.parametrize(
    "text",
    [
        f"key {KEY} used",
        f"b'GET / HTTP/1.1\\nAuthorization: Bearer {KEY}\\n\\n'",
        f"b'Authorization: Bearer\\r\\n {KEY}\\r\\n'",  # obs-folded, as a bytes repr quotes it
        f'{{"token": "{TOKEN}"}}',
        "Authorization: bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig",
        "upstream key sk-ant-api03-abcdefghijklmnop refused",
    ],
)
def test_secrets_are_redacted_whatever_surrounds_them(text: str) -> None:
    redacted = redact(text)
    assert REDACTED in redacted
    for secret in (KEY, TOKEN, "eyJhbGciOiJIUzI1NiJ9", "abcdefghijklmnop"):
        assert secret[-12:] not in redacted


@pytest.mark.parametrize("text", ["task-abcdefghijkl done", "model sk-1 (short)", "Bearer x"])
def test_what_is_not_a_secret_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_the_redacting_stream_redacts_each_write() -> None:
    out = io.StringIO()
    RedactingStream(out).write(f"{KEY}\n")
    assert out.getvalue() == f"sk-iop-{REDACTED}\n"


def _record(exc: BaseException, name: str = "aiohttp.server") -> logging.LogRecord:
    return logging.LogRecord(
        name,
        logging.ERROR,
        __file__,
        1,
        "Error handling request from %s",
        ("127.0.0.1",),
        (type(exc), exc, None),
    )


def test_an_http_parse_error_is_one_line_without_its_bytes() -> None:
    records: list[str] = []
    sink = logger.add(records.append, format="{level} {message}", level="DEBUG")
    try:
        bad = BadStatusLine(f"GET / HTTP/1.1\nAuthorization: Bearer {KEY}\n\n")
        LoguruBridge().emit(_record(bad))
    finally:
        logger.remove(sink)
    [record] = records
    assert record.startswith("INFO Error handling request from 127.0.0.1: malformed HTTP request")
    assert "BadStatusLine" in record
    assert KEY[-12:] not in record
    assert "Traceback" not in record
    assert record.count("\n") == 1


def test_other_library_records_keep_their_level_and_traceback() -> None:
    records: list[str] = []
    sink = logger.add(records.append, format="{level} {message}", level="DEBUG")
    try:
        try:
            raise RuntimeError("a bug")
        except RuntimeError as exc:
            LoguruBridge().emit(_record(exc, "asyncio"))
    finally:
        logger.remove(sink)
    [record] = records
    assert record.startswith("ERROR asyncio: Error handling request from 127.0.0.1")
    assert "RuntimeError: a bug" in record


# --- traced requests ------------------------------------------------------------------------


def test_a_traced_line_names_its_trace_and_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Lines logged inside a traced request (``iop_proto.tracing``) carry its ids in the
    human format too (the JSON one has them in ``extra``); others are unchanged."""
    from iop_proto.service.logging import configure_logging
    from iop_proto.service.settings import LogSettings

    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    configure_logging("node", LogSettings())
    try:
        with logger.contextualize(run_id="run-1", trace_id=trace):
            logger.info("in a run")
        with logger.contextualize(trace_id=trace):
            logger.info("at the edge")
        logger.info("outside")
    finally:
        logger.remove()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(f"node in a run [run run-1 trace {trace}]"), lines
    assert lines[1].endswith(f"node at the edge [trace {trace}]"), lines
    assert lines[2].endswith("node outside"), lines
