"""The batch store's backends, for contract tests that run the same functions on each.

``batch_backend`` is parametrised: SQLite (a file in the test's directory) and
PostgreSQL (a fresh database on the real throwaway server of
``iop_proto.pytest_postgres``). A test opens stores through it (again, after a
simulated restart) and asks it what only a backend can see: what an upload left
behind, whether a content is gone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from pydantic import SecretStr

from iop_edge.adapters.batch_store import SqliteBatchStore
from iop_edge.adapters.pg_batch_store import PostgresBatchStore
from iop_proto.postgres import PostgresSettings, open_pool


class BatchBackend:
    """Opens stores of one backend; ``pool`` is set on PostgreSQL."""

    def __init__(self, name: str, path: Path, pool: asyncpg.Pool | None) -> None:
        self.name = name
        self.path = path
        self.pool = pool

    async def open(
        self, clock: Callable[[], float] = time.time, *, file_ttl_s: int = 0
    ) -> SqliteBatchStore | PostgresBatchStore:
        if self.pool is None:
            return await SqliteBatchStore.open(self.path, file_ttl_s=file_ttl_s, clock=clock)
        return await PostgresBatchStore.open(self.pool, file_ttl_s=file_ttl_s, clock=clock)

    async def leftovers(self, store: Any) -> list[str]:
        """Every content the store holds (stored or not): a directory's entries, or the
        content and chunk rows."""
        if self.pool is None:
            return sorted(entry.name for entry in store.contents.path.iterdir())
        rows = await self.pool.fetch(
            "SELECT file_id FROM edge_file_contents UNION SELECT file_id FROM edge_file_chunks"
        )
        return sorted(str(row[0]) for row in rows)

    async def content_removed(self, store: Any, file_id: str) -> bool:
        """The content is no file's any more: removed from disk, or marked deleted (its
        chunks purged after the read grace) or gone."""
        if self.pool is None:
            return not store.contents.content_path(file_id).exists()
        state = await self.pool.fetchval(
            "SELECT state FROM edge_file_contents WHERE file_id = $1", file_id
        )
        return state in (None, "deleted")


@pytest.fixture(params=["sqlite", "postgres"])
async def batch_backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[BatchBackend]:
    path = tmp_path / "state" / "batches.db"
    if request.param == "sqlite":
        yield BatchBackend("sqlite", path, None)
        return
    dsn = request.getfixturevalue("postgres_dsn")
    pool = await open_pool(PostgresSettings(dsn=SecretStr(dsn), max_connections=8))
    try:
        yield BatchBackend("postgres", path, pool)
    finally:
        await pool.close()
