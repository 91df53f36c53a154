"""The batch store's file: owner-only, WAL, a versioned schema, one transaction helper.

Apart from ``batch_store`` so that the store module holds only what the
service asks of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import aiosqlite

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
    await asyncio.to_thread(_prepare_file, path)
    # isolation_level=None: autocommit, so transactions are exactly the ones we BEGIN.
    db = await aiosqlite.connect(path, isolation_level=None, timeout=busy_timeout_s)
    try:
        await _set_up(db, path)
    except BaseException:
        await db.close()
        raise
    return db


def _prepare_file(path: Path) -> None:
    """Owner-only directories and file: uploads and results are the clients' data."""
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)


@contextlib.asynccontextmanager
async def transaction(db: aiosqlite.Connection) -> AsyncIterator[None]:
    """One write transaction, rolled back on any error (cancellation included)."""
    await db.execute("BEGIN IMMEDIATE")
    try:
        yield
        await db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
        raise


async def _set_up(db: aiosqlite.Connection, path: Path) -> None:
    """Check the version first, so a newer edge's file is refused before anything changes."""
    async with transaction(db):
        async with db.execute("PRAGMA user_version") as cursor:
            row = await cursor.fetchone()
        version = int(row[0]) if row is not None else 0
        if version > SCHEMA_VERSION:
            raise BatchStoreError(
                f"{path}: batch store schema version {version} is newer than this edge "
                f"understands ({SCHEMA_VERSION}); upgrade the edge or move the file away"
            )
        if version < SCHEMA_VERSION:
            for statement in _SCHEMA:
                await db.execute(statement)
            await db.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
    async with db.execute("PRAGMA journal_mode = WAL") as cursor:
        row = await cursor.fetchone()
    mode = str(row[0]).lower() if row is not None else "unknown"
    if mode != "wal":
        raise BatchStoreError(
            f"{path}: SQLite refused WAL journal mode (got {mode!r}); "
            "put the batch store on a local filesystem"
        )
    # FULL: a finished line's commit survives a power loss too (one fsync per line,
    # on aiosqlite's thread; a line is an LLM call, so the fsync is noise).
    await db.execute("PRAGMA synchronous = FULL")
