"""The response store's file: its schema, its migration and its queries.

Apart from ``sqlite_responses`` so that the store module holds only what the
service asks of it (as ``batch_schema`` is for the batch store).

Version 2: one row per turn (its own input items and its Response object) with
a link to the turn it continued (``previous_id``), its ``depth`` in the chain,
its ``bytes`` (what its key is charged), and ``deleted_at`` (Unix seconds; 0 while
not deleted) in place of version 1's ``deleted`` flag. Version 1 kept each turn
with the whole conversation before it: such a row becomes the first turn of its
conversation (no link, depth 0), its items as they were, so every stored answer
reads, lists and continues as before; a version-1 deletion (``deleted`` = 1)
reads as deleted in 1970, and the first sweep removes it.
"""

from __future__ import annotations

from typing import Final

import aiosqlite

from iop_edge.errors import StorageQuotaExceeded

SCHEMA_VERSION: Final = 2
"""Kept in ``PRAGMA user_version``; bump it with a migration when the table changes."""

COLUMNS: Final = (
    "response_id",
    "key_id",
    "created_at",
    "response_json",
    "input_json",
    "deleted_at",
    "previous_id",
    "depth",
    "bytes",
)
"""In the order of the table (version 1's columns, then those version 2 added)."""

SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS responses (
        response_id   TEXT PRIMARY KEY,
        key_id        TEXT NOT NULL,
        created_at    INTEGER NOT NULL,
        response_json BLOB NOT NULL,
        input_json    BLOB NOT NULL,
        deleted_at    INTEGER NOT NULL DEFAULT 0,
        previous_id   TEXT,
        depth         INTEGER NOT NULL DEFAULT 0,
        bytes         INTEGER NOT NULL DEFAULT 0
    )""",
    # The sweep asks which turns are continued from, and which are old.
    "CREATE INDEX IF NOT EXISTS responses_previous ON responses (previous_id)",
    "CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at)",
)

INSERT: Final = (
    f"INSERT OR REPLACE INTO responses ({', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(COLUMNS))})"
)
SELECT: Final = f"SELECT {', '.join(COLUMNS)} FROM responses WHERE response_id = ?"

CHAIN: Final = f"""WITH RECURSIVE chain(id, n) AS (
    SELECT ?1, 0
    UNION ALL
    SELECT r.previous_id, chain.n + 1 FROM responses r JOIN chain ON r.response_id = chain.id
    WHERE r.previous_id IS NOT NULL AND chain.n < ?2
)
SELECT {", ".join(f"r.{c}" for c in COLUMNS)} FROM chain
JOIN responses r ON r.response_id = chain.id ORDER BY chain.n"""
"""A turn (?1) and up to ?2 turns before it, the latest first."""

REMOVE_UNCONTINUED: Final = """DELETE FROM responses WHERE response_id = ?1 AND deleted_at > 0
AND NOT EXISTS (SELECT 1 FROM responses c WHERE c.previous_id = ?1)"""
"""A deleted turn's row, unless a later turn continues from it."""

USAGE: Final = "SELECT key_id, SUM(bytes) FROM responses GROUP BY key_id"

_ENDED: Final = (
    "((deleted_at > 0 AND deleted_at <= :deleted_before) OR created_at <= :created_before)"
)

DEAD_UNREFERENCED: Final = f"""WITH RECURSIVE kept(id) AS (
    SELECT response_id FROM responses WHERE NOT {_ENDED}
    UNION
    SELECT r.previous_id FROM responses r JOIN kept ON r.response_id = kept.id
    WHERE r.previous_id IS NOT NULL
)
SELECT response_id, key_id, bytes FROM responses WHERE {_ENDED} AND response_id NOT IN kept"""
"""Turns ended long enough ago that no turn still standing continues from, directly or
through other ended turns (``kept``: every standing turn and everything it continues;
a turn ended less than the grace ago still stands)."""

_FROM_V1: Final = (
    "ALTER TABLE responses RENAME COLUMN deleted TO deleted_at",
    "ALTER TABLE responses ADD COLUMN previous_id TEXT",
    "ALTER TABLE responses ADD COLUMN depth INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0",
    "UPDATE responses SET bytes = length(response_json) + length(input_json)",
)


async def migrate(db: aiosqlite.Connection, version: int) -> None:
    """Bring a file of ``version`` up to ``SCHEMA_VERSION`` (in ``open_database``'s
    transaction: a crash leaves the old version whole)."""
    if version == 1:
        for statement in _FROM_V1:
            await db.execute(statement)


def check_quota(used: int, incoming: int, quota: int) -> None:
    """``admit``'s rule on both backends: ``incoming`` more bytes must fit the key's
    ``quota`` (0: no quota) beside the ``used`` it already has."""
    if quota and used + incoming > quota:
        raise StorageQuotaExceeded(
            f"This API key's stored responses take {used} bytes of its {quota}-byte"
            " storage quota; delete stored responses, or send store: false.",
            param="store",
        )
