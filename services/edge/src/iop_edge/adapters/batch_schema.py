"""The batch store's file: owner-only, WAL, a versioned schema, one transaction helper.

Apart from ``batch_store`` so that the store module holds only what the
service asks of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import aiosqlite

from iop_edge.adapters.sqlite_file import open_database

SCHEMA_VERSION: Final = 1
"""Kept in ``PRAGMA user_version``; bump it with a migration when a table changes."""

BUSY_TIMEOUT_S: Final = 5.0

_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS files (
        id          TEXT PRIMARY KEY,
        filename    TEXT NOT NULL,
        purpose     TEXT NOT NULL,
        bytes       INTEGER NOT NULL,
        created_at  INTEGER NOT NULL,
        content     BLOB NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS batches (
        seq               INTEGER PRIMARY KEY AUTOINCREMENT,
        id                TEXT NOT NULL UNIQUE,
        input_file_id     TEXT NOT NULL,
        endpoint          TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        metadata          TEXT,
        status            TEXT NOT NULL,
        created_at        INTEGER NOT NULL,
        in_progress_at    INTEGER,
        finalizing_at     INTEGER,
        completed_at      INTEGER,
        failed_at         INTEGER,
        expired_at        INTEGER,
        cancelling_at     INTEGER,
        cancelled_at      INTEGER,
        expires_at        INTEGER NOT NULL,
        output_file_id    TEXT,
        error_file_id     TEXT,
        errors            TEXT,
        total_lines       INTEGER NOT NULL,
        lease_id          TEXT UNIQUE,
        lease_owner       TEXT,
        lease_expires_at  REAL,
        finalize_as       TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status, seq)",
    """CREATE TABLE IF NOT EXISTS batch_lines (
        batch_id     TEXT NOT NULL,
        line_number  INTEGER NOT NULL,
        custom_id    TEXT NOT NULL,
        body         TEXT NOT NULL,
        state        TEXT NOT NULL,
        status_code  INTEGER,
        response     TEXT,
        error        TEXT,
        request_id   TEXT,
        result_id    TEXT,
        finished_at  INTEGER,
        PRIMARY KEY (batch_id, line_number)
    ) WITHOUT ROWID""",
    # Counts and "first unfinished line" read this instead of a batch's every row.
    "CREATE INDEX IF NOT EXISTS batch_lines_state ON batch_lines (batch_id, state, line_number)",
)


class BatchStoreError(Exception):
    """The batch store cannot be used (a schema from a newer edge, no WAL)."""


async def connect(path: Path, busy_timeout_s: float) -> aiosqlite.Connection:
    """Open (creating if needed) the file, checked and migrated; the caller closes it."""
    # FULL: a finished line's commit survives a power loss too (one fsync per line,
    # on aiosqlite's thread; a line is an LLM call, so the fsync is noise).
    return await open_database(
        path,
        busy_timeout_s=busy_timeout_s,
        what="batch store",
        schema=_SCHEMA,
        schema_version=SCHEMA_VERSION,
        synchronous="FULL",
        error=BatchStoreError,
    )
