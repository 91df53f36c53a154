"""A real credential store for the store and command tests, on each backend in turn:
a temporary SQLite file, and an empty database on a real PostgreSQL server
(``postgres_server`` from ``iop_proto.pytest_postgres``; skipped where none can run)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from pydantic import SecretStr

from iop_control_plane.adapters.postgres_store import PostgresCredentialStore
from iop_control_plane.adapters.sqlite_store import SqliteCredentialStore
from iop_control_plane.ports import OpenedCredentialStore
from iop_proto.postgres import PostgresSettings
from iop_proto.testing_postgres import PostgresServer

# Every statement a connection to the test's database runs goes to the server's log
# (values included), so the tests that look for a secret in logs look there too.
_LOG_STATEMENTS = """DO $$ BEGIN
    EXECUTE format('ALTER DATABASE %I SET log_statement = ''all''', current_database());
END $$"""

Reopen = Callable[[], Awaitable[OpenedCredentialStore]]


@dataclass(frozen=True)
class Backend:
    """One store, as several processes see it: each ``open()`` is a new connection to it."""

    name: str
    open: Reopen
    db_path: Path | None = None  # the SQLite file; None on PostgreSQL
    dsn: str | None = None  # the PostgreSQL database; None on SQLite
    server_log: Path | None = None  # the PostgreSQL server's log (every statement)


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        path = tmp_path / "state" / "credentials.db"  # the parent does not exist yet

        async def open_sqlite() -> OpenedCredentialStore:
            return await SqliteCredentialStore.open(path)

        return Backend("sqlite", open_sqlite, db_path=path)
    server: PostgresServer = request.getfixturevalue("postgres_server")
    dsn = server.create_database()
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(_LOG_STATEMENTS)
    finally:
        await connection.close()
    settings = PostgresSettings(dsn=SecretStr(dsn))

    async def open_postgres() -> OpenedCredentialStore:
        return await PostgresCredentialStore.open(settings)

    return Backend("postgres", open_postgres, dsn=dsn, server_log=server.directory / "log")


@pytest.fixture
def reopen(backend: Backend) -> Reopen:
    """Another connection to the test's store, as another process (the CLI) opens it."""
    return backend.open


@pytest.fixture
def server_log(backend: Backend) -> Path | None:
    """The PostgreSQL server's log, where every statement on the test's database goes."""
    return backend.server_log


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[OpenedCredentialStore]:
    opened = await backend.open()
    try:
        yield opened
    finally:
        await opened.aclose()
