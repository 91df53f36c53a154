"""The batch store's SQL text and row mapping: what a row of ``files``, ``batches`` and
``batch_lines`` holds, apart from the store's transactions (``batch_store``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Final

from iop_edge.domain.batches import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    DONE,
    EXPIRED,
    LINE_FAILED,
    PENDING,
    RUNNABLE,
    BatchRecord,
    FileRecord,
    InputLine,
    LineRecord,
    LineResult,
)


def batch_select(batches: str, lines: str) -> str:
    """The ``SELECT`` of a batch row and its line counts, over tables of these names
    (SQLite's ``batches``/``batch_lines``, PostgreSQL's ``edge_``-prefixed ones)."""
    return f"""SELECT b.id, b.input_file_id, b.endpoint, b.completion_window,
    b.metadata, b.status, b.created_at, b.in_progress_at, b.finalizing_at, b.completed_at,
    b.failed_at, b.expired_at, b.cancelling_at, b.cancelled_at, b.expires_at,
    b.output_file_id, b.error_file_id, b.errors, b.total_lines,
    (SELECT COUNT(*) FROM {lines} l WHERE l.batch_id = b.id AND l.state = '{DONE}'),
    (SELECT COUNT(*) FROM {lines} l WHERE l.batch_id = b.id AND l.state = '{LINE_FAILED}'),
    b.lease_id, b.lease_owner, b.lease_expires_at, b.finalize_as, b.owner
    FROM {batches} b"""


BATCH_SELECT: Final = batch_select("batches", "batch_lines")
FILE_SELECT: Final = "SELECT id, filename, purpose, bytes, created_at, owner FROM files"
RUNNABLE_SQL: Final = ", ".join(f"'{status}'" for status in RUNNABLE)
UNENDED_SQL: Final = f"{RUNNABLE_SQL}, '{CANCELLING}'"
"""A batch that may still be cancelled or frozen: running, waiting, or cancelling."""
LEASE_FREE: Final = "(b.lease_expires_at IS NULL OR b.lease_expires_at <= :now)"
LINE_COLUMNS: Final = (
    "batch_id, line_number, custom_id, body, state, status_code, response, error, "
    "request_id, result_id"
)
TIMESTAMP_OF: Final = {
    COMPLETED: "completed_at",
    CANCELLED: "cancelled_at",
    EXPIRED: "expired_at",
}

INSERT_FILE: Final = (
    "INSERT INTO files (id, filename, purpose, bytes, created_at, owner) VALUES (?, ?, ?, ?, ?, ?)"
)


def file_row(record: FileRecord) -> tuple[object, ...]:
    return (
        record.id,
        record.filename,
        record.purpose,
        record.bytes,
        record.created_at,
        record.owner,
    )


def new_line_row(
    batch: BatchRecord, line: InputLine, result: LineResult | None
) -> tuple[object, ...]:
    head = (batch.id, line.index, line.custom_id, line.body_json)
    if result is None:
        return (*head, PENDING, None, None, None, None, None, None)
    return (
        *head,
        result.state,
        result.status_code,
        result.response,
        result.error,
        result.request_id,
        result.result_id,
        batch.created_at,
    )


def json_text(value: object) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def batch_record(row: Iterable[Any]) -> BatchRecord:
    values = list(row)
    values[4] = None if values[4] is None else json.loads(values[4])  # metadata
    values[17] = None if values[17] is None else json.loads(values[17])  # errors
    return BatchRecord(*values)


def line_record(row: Sequence[Any]) -> LineRecord:
    batch_id, index, custom_id, body, state, status_code, response, error, request_id, result_id = (
        row
    )
    result = (
        None
        if state == PENDING
        else LineResult(state, status_code, response, error, request_id or "", result_id or "")
    )
    return LineRecord(batch_id, index, custom_id, body, result)
