"""The batch store's file: owner-only, WAL, a versioned schema and its migrations.

Apart from ``batch_store`` so that the store module holds only what the
service asks of it.

Version 2: files and batches have an ``owner`` (the creator's ``key_id``), and
a file's content lives in ``ContentDir``, not in a BLOB. A version-1 file is
migrated when the edge opens it: each old BLOB is copied out (one at a time,
whole: this once), the ``files`` table is rebuilt without the column, and
every existing file and batch is owned by nobody (``owner`` NULL): only
operator keys and the open API see them. The pages the BLOBs held stay free
space in the file until a ``VACUUM``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Final

import aiosqlite
from loguru import logger

from iop_edge.adapters.batch_files import ContentDir
from iop_proto.sqlite import open_database

SCHEMA_VERSION: Final = 2
"""Kept in ``PRAGMA user_version``; bump it with a migration when a table changes."""

BUSY_TIMEOUT_S: Final = 5.0

_FILES: Final = """CREATE TABLE IF NOT EXISTS {name} (
        id          TEXT PRIMARY KEY,
        filename    TEXT NOT NULL,
        purpose     TEXT NOT NULL,
        bytes       INTEGER NOT NULL,
        created_at  INTEGER NOT NULL,
        owner       TEXT
    )"""

_SCHEMA: Final = (
    _FILES.format(name="files"),
    "CREATE INDEX IF NOT EXISTS files_owner ON files (owner)",
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
        finalize_as       TEXT,
        owner             TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status, seq)",
    "CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq)",
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


async def connect(path: Path, busy_timeout_s: float, contents: ContentDir) -> aiosqlite.Connection:
    """Open (creating if needed) the file, checked and migrated; the caller closes it.

    ``contents`` must exist: a version-1 file's BLOBs are moved there.
    """

    async def migrate(db: aiosqlite.Connection, version: int) -> None:
        if version == 1:
            await _from_v1(db, contents)

    # FULL: a finished line's commit survives a power loss too (one fsync per line,
    # on aiosqlite's thread; a line is an LLM call, so the fsync is noise).
    return await open_database(
        path,
        busy_timeout_s=busy_timeout_s,
        what="batch store",
        owner="edge",
        schema=_SCHEMA,
        schema_version=SCHEMA_VERSION,
        synchronous="FULL",
        error=BatchStoreError,
        migrate=migrate,
    )


async def _from_v1(db: aiosqlite.Connection, contents: ContentDir) -> None:
    """Version 1 to 2: BLOBs out to ``contents``, ``owner`` columns in (NULL: nobody's).

    The contents are durable before the transaction commits; if it does not, they
    are content without a row, removed by the sweep at the next open (which
    migrates again).
    """
    ids = [str(row[0]) for row in await db.execute_fetchall("SELECT id FROM files ORDER BY rowid")]
    for file_id in ids:
        rows = list(await db.execute_fetchall("SELECT content FROM files WHERE id = ?", (file_id,)))
        await asyncio.to_thread(contents.write, file_id, bytes(rows[0][0]))
    await db.execute(_FILES.format(name="files_v2"))
    await db.execute(
        """INSERT INTO files_v2 (id, filename, purpose, bytes, created_at)
        SELECT id, filename, purpose, bytes, created_at FROM files ORDER BY rowid"""
    )
    await db.execute("DROP TABLE files")
    await db.execute("ALTER TABLE files_v2 RENAME TO files")
    await db.execute("ALTER TABLE batches ADD COLUMN owner TEXT")
    logger.info(
        "batch store: migrated to version 2 ({} files moved to {}; every existing file and "
        "batch is owned by nobody: only operator keys see it)",
        len(ids),
        contents.path,
    )
