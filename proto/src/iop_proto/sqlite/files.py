"""Opening a service's SQLite file the one way every IOP service opens them.

Owner-only files (they hold clients' data, tokens' hashes, provider output),
autocommit connections whose transactions are exactly the ones we ``BEGIN``, a
schema version checked before anything changes (a file from a newer release is
refused and left as it was), and WAL journal mode, so readers never wait for
the writer. The edge's run log and batch store, the node's run history and the
control-plane's credential store all open their files here.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import aiosqlite

Migration = Callable[[aiosqlite.Connection, int], Awaitable[None]]
"""Brings a file from the version given up to date, inside the open transaction."""


def prepare_file(path: Path) -> None:
    """Create owner-only directories and file before SQLite opens it.

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
    any row is written (and two processes creating one file cannot both do it).
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


def statement_migrations(steps: Mapping[int, Sequence[str]], schema_version: int) -> Migration:
    """A ``Migration`` from plain statements: ``steps[v]`` brings version ``v`` to ``v + 1``."""

    async def migrate(db: aiosqlite.Connection, version: int) -> None:
        for step in range(version, schema_version):
            for statement in steps.get(step, ()):
                await db.execute(statement)

    return migrate


async def open_database(
    path: Path,
    *,
    busy_timeout_s: float,
    what: str,
    owner: str,
    schema: Sequence[str],
    schema_version: int,
    synchronous: Literal["NORMAL", "FULL"],
    error: type[Exception],
    migrate: Migration | None = None,
) -> aiosqlite.Connection:
    """Open (creating if needed) ``path``, checked and migrated; the caller closes it.

    ``what`` names the file in errors (``run log``, ``batch store``), ``owner``
    the program that opens it (``edge``); ``error`` is the caller's exception
    type for a file it cannot use. ``migrate`` brings a file of an older version
    (1 or more) up to ``schema_version``; it runs in the same transaction as
    ``schema`` (idempotent ``CREATE ... IF NOT EXISTS`` statements, which run
    next, statement by statement: ``executescript`` would commit the open
    transaction), so a crash leaves the old version whole.
    """
    await asyncio.to_thread(prepare_file, path)
    db = await aiosqlite.connect(path, isolation_level=None, timeout=busy_timeout_s)
    try:
        async with transaction(db):
            await _check_version(db, path, what, owner, schema, schema_version, error, migrate)
        await _use_wal(db, path, what, synchronous, error)
    except BaseException:
        await db.close()
        raise
    return db


async def _check_version(
    db: aiosqlite.Connection,
    path: Path,
    what: str,
    owner: str,
    schema: Sequence[str],
    schema_version: int,
    error: type[Exception],
    migrate: Migration | None,
) -> None:
    """First, so a newer release's file is refused before anything changes."""
    async with db.execute("PRAGMA user_version") as cursor:
        row = await cursor.fetchone()
    version = int(row[0]) if row is not None else 0
    if version > schema_version:
        raise error(
            f"{path}: {what} schema version {version} is newer than this {owner} "
            f"understands ({schema_version}); upgrade the {owner} or move the file away"
        )
    if version < schema_version:
        if version and migrate is not None:
            await migrate(db, version)
        for statement in schema:
            await db.execute(statement)
        await db.execute(f"PRAGMA user_version = {schema_version:d}")


async def _use_wal(
    db: aiosqlite.Connection, path: Path, what: str, synchronous: str, error: type[Exception]
) -> None:
    async with db.execute("PRAGMA journal_mode = WAL") as cursor:
        row = await cursor.fetchone()
    mode = str(row[0]).lower() if row is not None else "unknown"
    if mode != "wal":
        raise error(
            f"{path}: SQLite refused WAL journal mode (got {mode!r}); "
            f"put the {what} on a local filesystem"
        )
    await db.execute(f"PRAGMA synchronous = {synchronous}")
