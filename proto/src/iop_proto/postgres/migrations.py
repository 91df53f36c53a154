"""A component's schema, brought up to date once even when several processes start at once."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from iop_proto.postgres.errors import reachable

_LEDGER = """
CREATE TABLE IF NOT EXISTS iop_schema_versions (
    component TEXT PRIMARY KEY,
    version INTEGER NOT NULL
)
"""


async def apply_migrations(pool: asyncpg.Pool, component: str, steps: Sequence[str]) -> int:
    """Run ``steps[version:]`` for ``component`` (each step a SQL script), in one
    transaction under an advisory lock, and return the version reached.

    The lock is keyed by the component's name, so two edges starting together
    migrate one after the other and the second finds nothing to do; a step that
    fails rolls back with the ledger, leaving the schema as it was.
    """
    with reachable(f"migrating {component}"):
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", component)
            await connection.execute(_LEDGER)
            version = await connection.fetchval(
                "SELECT version FROM iop_schema_versions WHERE component = $1", component
            )
            current = int(version or 0)
            if current > len(steps):
                raise RuntimeError(
                    f"{component}: the store is at schema version {current}, newer than this "
                    f"release's {len(steps)}; upgrade this service first"
                )
            for step in steps[current:]:
                await connection.execute(step)
            await connection.execute(
                "INSERT INTO iop_schema_versions (component, version) VALUES ($1, $2) "
                "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version",
                component,
                len(steps),
            )
    return len(steps)
