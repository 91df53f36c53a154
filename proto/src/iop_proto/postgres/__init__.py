"""PostgreSQL the way every IOP service keeps shared state: one pool, one migration runner.

SQLite stays each service's embedded default; a service configured with a
``postgres`` section keeps the same ports on PostgreSQL, so several edges (or
control-planes) see one store. ``pool`` opens a bounded asyncpg pool,
``migrations`` brings a component's schema up to date under an advisory lock
(several processes may start at once), ``errors`` turns a lost server into the
one retryable ``StorageUnavailable``.
"""

from iop_proto.postgres.errors import StorageUnavailable, reachable
from iop_proto.postgres.migrations import apply_migrations
from iop_proto.postgres.pool import open_pool
from iop_proto.postgres.settings import PostgresSettings

__all__ = [
    "PostgresSettings",
    "StorageUnavailable",
    "apply_migrations",
    "open_pool",
    "reachable",
]
