"""Opening the edge's SQLite files the one way they are all opened.

Owner-only files, autocommit connections whose transactions are exactly the
ones we ``BEGIN``, a schema version checked before anything changes (a file
from a newer edge is refused), and WAL journal mode. Used by the run log and
the batch store.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import aiosqlite


def prepare_file(path: Path) -> None:
    """Create owner-only directories and file: these files hold clients' data.

    Each missing directory gets 0700 (``mkdir(parents=True)`` would not give it to
    the upper ones); SQLite gives its -wal and -shm files the database's mode.
    """
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)


@contextlib.asynccontextmanager
async def transaction(db: aiosqlite.Connection) -> AsyncIterator[None]:
    """One write transaction, rolled back on any error (cancellation included).

    IMMEDIATE takes the write lock up front, so a busy database fails before
    any row is written.
    """
    await db.execute("BEGIN IMMEDIATE")
    try:
        yield
        await db.execute("COMMIT")
    except BaseException:
        # A failing rollback (COMMIT may have ended the transaction after all)
        # must not replace the error, least of all a cancellation.
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
        raise


async def open_database(
    path: Path,
    *,
    busy_timeout_s: float,
    what: str,
    schema: Sequence[str],
    schema_version: int,
    synchronous: Literal["NORMAL", "FULL"],
    error: type[Exception],
    migrations: Mapping[int, Sequence[str]] | None = None,
) -> aiosqlite.Connection:
    """Open (creating if needed) ``path``, checked and migrated; the caller closes it.

    ``what`` names the file in errors (``run log``, ``batch store``); ``error``
    is the caller's exception type for a file this edge cannot use. A new file
    gets ``schema``; a file at an older version ``v`` gets ``migrations[v]``,
    ``migrations[v + 1]`` ... and then ``schema`` (idempotent statements only: it
    adds what a migration does not, such as new indexes), in one transaction.
    """
    await asyncio.to_thread(prepare_file, path)
    db = await aiosqlite.connect(path, isolation_level=None, timeout=busy_timeout_s)
    try:
        await _set_up(db, path, what, schema, schema_version, synchronous, error, migrations or {})
    except BaseException:
        await db.close()
        raise
    return db


async def _set_up(
    db: aiosqlite.Connection,
    path: Path,
    what: str,
    schema: Sequence[str],
    schema_version: int,
    synchronous: str,
    error: type[Exception],
    migrations: Mapping[int, Sequence[str]],
) -> None:
    """Check the version first, so a newer edge's file is refused before anything changes."""
    async with transaction(db):
        async with db.execute("PRAGMA user_version") as cursor:
            row = await cursor.fetchone()
        version = int(row[0]) if row is not None else 0
        if version > schema_version:
            raise error(
                f"{path}: {what} schema version {version} is newer than this edge "
                f"understands ({schema_version}); upgrade the edge or move the file away"
            )
        if version < schema_version:
            steps = range(version, schema_version) if version else range(0)
            for statement in (*(s for v in steps for s in migrations.get(v, ())), *schema):
                await db.execute(statement)
            await db.execute(f"PRAGMA user_version = {schema_version:d}")
    async with db.execute("PRAGMA journal_mode = WAL") as cursor:
        row = await cursor.fetchone()
    mode = str(row[0]).lower() if row is not None else "unknown"
    if mode != "wal":
        raise error(
            f"{path}: SQLite refused WAL journal mode (got {mode!r}); "
            f"put the {what} on a local filesystem"
        )
    await db.execute(f"PRAGMA synchronous = {synchronous}")
