"""A bounded asyncpg pool for a service's shared store."""

from __future__ import annotations

import asyncpg

from iop_proto.postgres.errors import reachable
from iop_proto.postgres.settings import PostgresSettings


async def open_pool(settings: PostgresSettings) -> asyncpg.Pool:
    """Open the pool; raises ``StorageUnavailable`` when the server cannot be reached."""
    with reachable("opening the pool"):
        pool = await asyncpg.create_pool(
            dsn=settings.dsn.get_secret_value(),
            min_size=min(settings.min_connections, settings.max_connections),
            max_size=settings.max_connections,
            timeout=settings.connect_timeout_s,
            command_timeout=settings.command_timeout_s,
        )
    assert pool is not None  # create_pool returns None only when awaited with a loop hook
    return pool
