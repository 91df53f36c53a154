"""The PostgreSQL store's backup (iop_proto.backup.pg_tools) against a real server: pg_dump
while it is in use, pg_restore putting the rows back, and a newer schema refused."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from iop_proto.backup import BackupError, ServiceState, make_backup, restore_backup
from iop_proto.postgres import apply_migrations, open_pool
from iop_proto.postgres.settings import PostgresSettings

STEPS = ("CREATE TABLE cp_keys (id TEXT PRIMARY KEY)",)


def _state(dsn: str, steps: int = 1) -> ServiceState:
    return ServiceState("control-plane", "test", postgres_dsn=dsn, postgres_versions={"cp": steps})


async def _ids(dsn: str) -> list[str]:
    connection = await asyncpg.connect(dsn)
    try:
        return [row["id"] for row in await connection.fetch("SELECT id FROM cp_keys ORDER BY id")]
    finally:
        await connection.close()


async def test_dump_and_restore_put_the_rows_back(postgres_dsn: str, tmp_path: Path) -> None:
    pool = await open_pool(PostgresSettings(dsn=postgres_dsn))  # type: ignore[arg-type]
    try:
        await apply_migrations(pool, "cp", STEPS)
        await pool.execute("INSERT INTO cp_keys VALUES ('a'), ('b')")
        manifest = make_backup(_state(postgres_dsn), tmp_path / "backup")
        assert manifest.postgres == {"cp": 1}
        await pool.execute("DELETE FROM cp_keys WHERE id = 'a'")
        await pool.execute("INSERT INTO cp_keys VALUES ('after')")
    finally:
        await pool.close()
    with pytest.raises(BackupError, match="schema is at version 1, newer than this release's 0"):
        restore_backup(_state(postgres_dsn, steps=0), tmp_path / "backup")
    assert await _ids(postgres_dsn) == ["after", "b"]  # a refused restore changes nothing
    with pytest.raises(BackupError, match="would replace the PostgreSQL store's contents"):
        restore_backup(_state(postgres_dsn), tmp_path / "backup")
    restore_backup(_state(postgres_dsn), tmp_path / "backup", force=True)
    assert await _ids(postgres_dsn) == ["a", "b"]
