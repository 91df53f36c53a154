"""Stored Responses API answers on the PostgreSQL store every edge of a fleet shares.

The SQLite store's model (``sqlite_responses``), in one table every edge reads
and writes: one row per turn, linked to the turn it continued (``previous_id``),
so a conversation grows by what each request brings, once, and a
``previous_response_id`` made on one edge continues on any other. A turn is
found only by the key that made it, until it expires (``ttl_s``) or is deleted;
rows go in a sweep, ``PURGE_GRACE_S`` after their end, once no turn still found
continues from them (every edge sweeps; the deletes are idempotent).

Durability: ``keep`` and ``delete`` return once their transaction has committed
on the server (PostgreSQL's own durability: ``synchronous_commit``, its WAL and
its replicas). Several edges write concurrently, so each statement is its own
transaction and nothing is held in an edge's memory first.

Outages: every call that reaches the server raises ``StorageUnavailable`` while
it cannot be reached (the API answers a retryable 503); nothing committed is
lost. Once a call has found it down, ``admit`` refuses ``store: true`` requests
with the same error before they run (no model's work is spent on an answer the
store could not keep), and checks in the background whether it is back: the
first call that reaches it again lifts that.

Quota: ``admit`` is synchronous (checked before a ``store: true`` request runs),
so it reads each key's bytes from memory: refreshed from the table when the
store opens, after each ``keep``/``delete`` of that key on this edge, and for
every key every ``usage_refresh_s``; a key writing through several edges at
once may overshoot its quota by what those edges admit within that window.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Final

import asyncpg
from loguru import logger

from iop_edge.adapters.response_rows import check_quota
from iop_edge.adapters.sqlite_responses import (
    PURGE_GRACE_S,
    ResponseLimits,
    ResponseStoreClosed,
)
from iop_edge.ports import StoredResponse
from iop_proto.postgres import StorageUnavailable, apply_migrations, reachable
from iop_proto.tasks import cancel_and_wait

COMPONENT: Final = "edge-responses"

STEPS: Final = (
    # 1: the SQLite store's version-2 table. Ids in the "C" collation (byte order).
    """CREATE TABLE edge_responses (
        response_id   TEXT COLLATE "C" PRIMARY KEY,
        key_id        TEXT NOT NULL,
        created_at    BIGINT NOT NULL,
        response_json BYTEA NOT NULL,
        input_json    BYTEA NOT NULL,
        deleted_at    BIGINT NOT NULL DEFAULT 0,
        previous_id   TEXT COLLATE "C",
        depth         INTEGER NOT NULL DEFAULT 0,
        bytes         BIGINT NOT NULL DEFAULT 0
    );
    -- the sweep asks which turns are continued from, and which are old; admit, a key's bytes
    CREATE INDEX edge_responses_previous ON edge_responses (previous_id);
    CREATE INDEX edge_responses_created ON edge_responses (created_at);
    CREATE INDEX edge_responses_key ON edge_responses (key_id);""",
)
"""Versioned steps (``iop_proto.postgres.apply_migrations``); append, never edit."""

_COLUMNS: Final = (
    "response_id, key_id, created_at, response_json, input_json, deleted_at, previous_id,"
    " depth, bytes"
)
_INSERT: Final = f"""INSERT INTO edge_responses ({_COLUMNS})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (response_id) DO UPDATE SET key_id = EXCLUDED.key_id,
    created_at = EXCLUDED.created_at, response_json = EXCLUDED.response_json,
    input_json = EXCLUDED.input_json, deleted_at = EXCLUDED.deleted_at,
    previous_id = EXCLUDED.previous_id, depth = EXCLUDED.depth, bytes = EXCLUDED.bytes"""
_SELECT: Final = f"SELECT {_COLUMNS} FROM edge_responses WHERE response_id = $1"
_CHAIN: Final = f"""WITH RECURSIVE chain(id, n) AS (
    SELECT $1::text COLLATE "C", 0
    UNION ALL
    SELECT r.previous_id, chain.n + 1 FROM edge_responses r JOIN chain ON r.response_id = chain.id
    WHERE r.previous_id IS NOT NULL AND chain.n < $2
)
SELECT {", ".join(f"r.{c.strip()}" for c in _COLUMNS.split(","))} FROM chain
JOIN edge_responses r ON r.response_id = chain.id ORDER BY chain.n"""
"""A turn ($1) and up to $2 turns before it, the latest first."""
_MARK_DELETED: Final = "UPDATE edge_responses SET deleted_at = $2 WHERE response_id = $1"
_REMOVE_UNCONTINUED: Final = """DELETE FROM edge_responses
WHERE response_id = $1 AND deleted_at > 0
AND NOT EXISTS (SELECT 1 FROM edge_responses c WHERE c.previous_id = $1)"""
"""A deleted turn's row, unless a later turn continues from it."""
_USAGE: Final = "SELECT key_id, SUM(bytes) FROM edge_responses GROUP BY key_id"
_KEY_USAGE: Final = "SELECT COALESCE(SUM(bytes), 0) FROM edge_responses WHERE key_id = $1"
_ENDED: Final = "((deleted_at > 0 AND deleted_at <= $1) OR created_at <= $2)"
_SWEEP: Final = f"""WITH RECURSIVE kept(id) AS (
    SELECT response_id FROM edge_responses WHERE NOT {_ENDED}
    UNION
    SELECT r.previous_id FROM edge_responses r JOIN kept ON r.response_id = kept.id
    WHERE r.previous_id IS NOT NULL
), victims AS (
    SELECT response_id FROM edge_responses
    WHERE {_ENDED} AND NOT EXISTS (SELECT 1 FROM kept WHERE kept.id = response_id)
    LIMIT $3
)
DELETE FROM edge_responses r USING victims v WHERE r.response_id = v.response_id
RETURNING r.key_id"""
"""Up to $3 turns ended long enough ago that no turn still standing continues from,
directly or through other ended turns (``kept``, as ``response_rows.DEAD_UNREFERENCED``),
found and removed in one statement: one snapshot, whichever edge sweeps."""
_SWEEP_CHUNK: Final = 500


class PostgresResponseStore:
    """A ``ResponseStore`` on a shared asyncpg pool; make it with ``await open(pool)``.

    The pool is the caller's (the edge's stores share it) and outlives the store.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        limits: ResponseLimits,
        clock: Callable[[], float],
        usage_refresh_s: float,
    ) -> None:
        """Use ``open``."""
        self.limits = limits
        self.max_depth = limits.max_depth
        self.purged = 0  # rows removed by this edge's sweeps, for tests and logs
        self._pool = pool
        self._clock = clock
        self._usage_refresh_s = usage_refresh_s
        self._usage: dict[str, int] = {}  # bytes per key, as last read from the table
        self._tasks: list[asyncio.Task[None]] = []
        self._outage: str | None = None  # why the last call found the server down
        self._probe: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        pool: asyncpg.Pool,
        *,
        limits: ResponseLimits | None = None,
        clock: Callable[[], float] = time.time,
        usage_refresh_s: float = 30.0,
    ) -> PostgresResponseStore:
        """Bring the table up to date and read each key's bytes; ``aclose()`` it.

        Raises ``StorageUnavailable`` when the server cannot be reached at start.
        """
        await apply_migrations(pool, COMPONENT, STEPS)
        store = cls(pool, limits or ResponseLimits(), clock, usage_refresh_s)
        await store.refresh_usage()
        store._tasks = [
            asyncio.create_task(store._sweep_forever(), name="edge-response-sweep"),
            asyncio.create_task(store._refresh_forever(), name="edge-response-usage"),
        ]
        logger.info("response store: on PostgreSQL")
        return store

    async def aclose(self) -> None:
        """Stop the sweep and the refresh; idempotent. The pool stays open (the caller's)."""
        self._closed = True
        tasks, self._tasks, self._probe = [*self._tasks, self._probe], [], None
        await cancel_and_wait(*tasks)

    def check_open(self) -> None:
        if self._closed:
            raise ResponseStoreClosed("response store (PostgreSQL) is closed")

    # -- ResponseStore -------------------------------------------------------------

    def admit(self, key_id: str, incoming: int) -> None:
        if self._outage is not None:
            if not self._closed and (self._probe is None or self._probe.done()):
                self._probe = asyncio.create_task(self._probe_once(), name="edge-response-probe")
            raise StorageUnavailable(self._outage)
        check_quota(self._usage.get(key_id, 0), incoming, self.limits.quota_bytes)

    def usage(self, key_id: str) -> int:
        """The bytes ``key_id``'s rows take, as ``admit`` counts them (last read)."""
        return self._usage.get(key_id, 0)

    async def keep(self, response: StoredResponse) -> None:
        self.check_open()
        with self._reach("storing a response"):
            async with self._pool.acquire() as connection:
                await connection.execute(_INSERT, *_row(response))
                used = await connection.fetchval(_KEY_USAGE, response.key_id)
        self._set_usage(response.key_id, int(used))

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        self.check_open()
        with self._reach("reading a stored response"):
            row = await self._pool.fetchrow(_SELECT, response_id)
        if row is None:
            return None
        found = _stored(row)
        return found if self._live(found, key_id) else None

    async def chain(self, response_id: str, key_id: str) -> list[StoredResponse] | None:
        self.check_open()
        with self._reach("reading a conversation"):
            rows = await self._pool.fetch(_CHAIN, response_id, self.max_depth)
        links = [_stored(row) for row in rows]
        if not links or not self._live(links[0], key_id):
            return None
        if links[-1].previous_id is not None and len(links) > self.max_depth:
            return None  # longer than a conversation may be: not read whole
        if any(link.key_id != key_id for link in links) or links[-1].previous_id is not None:
            # A turn it continues was deleted while this one was running (on any edge).
            logger.warning("response store: {} continues a removed turn", response_id)
            return None
        links.reverse()
        return links

    async def delete(self, response_id: str, key_id: str) -> bool:
        found = await self.get(response_id, key_id)
        if found is None:
            return False
        # Marked deleted, then the row goes at once unless a later turn continues from
        # it (then it stays, not found, until a sweep finds nothing continuing from it).
        with self._reach("deleting a stored response"):
            async with self._pool.acquire() as connection:
                async with connection.transaction():
                    await connection.execute(_MARK_DELETED, response_id, max(1, int(self._clock())))
                    removed = await connection.execute(_REMOVE_UNCONTINUED, response_id)
                used = await connection.fetchval(_KEY_USAGE, found.key_id)
        if removed != "DELETE 0":
            self.purged += 1
        self._set_usage(found.key_id, int(used))
        return True

    # -- the sweep and the usage ---------------------------------------------------

    async def sweep(self) -> int:
        """Remove the rows of turns over ``PURGE_GRACE_S`` past their end that no turn
        still found continues from; returns how many."""
        self.check_open()
        now = int(self._clock())
        ttl = self.limits.ttl_s
        deleted_before = now - PURGE_GRACE_S
        created_before = now - ttl - PURGE_GRACE_S if ttl else -1
        removed = 0
        while True:
            with self._reach("sweeping stored responses"):
                rows = await self._pool.fetch(_SWEEP, deleted_before, created_before, _SWEEP_CHUNK)
            removed += len(rows)
            if len(rows) < _SWEEP_CHUNK:
                break
        self.purged += removed
        if removed:
            logger.info("response store: {} ended turns removed", removed)
            await self.refresh_usage()
        return removed

    async def refresh_usage(self) -> None:
        """Read every key's bytes from the table (other edges' turns included)."""
        with self._reach("reading the stored responses' usage"):
            rows = await self._pool.fetch(_USAGE)
        self._usage = {str(key_id): int(used) for key_id, used in rows if used}

    async def _probe_once(self) -> None:
        with contextlib.suppress(StorageUnavailable):
            await self.refresh_usage()  # reaching the server lifts the outage

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                logger.exception("response store: sweep failed; the next tries again")

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._usage_refresh_s)
            try:
                await self.refresh_usage()
            except Exception as exc:  # down: admit keeps the last figures meanwhile
                logger.warning("response store: usage not refreshed: {}", exc)

    # -- internals -----------------------------------------------------------------

    @contextlib.contextmanager
    def _reach(self, what: str) -> Iterator[None]:
        """``reachable``, noting whether the server answered (``admit`` reads it)."""
        try:
            with reachable(what):
                yield
        except StorageUnavailable as exc:
            self._outage = str(exc)
            raise
        self._outage = None

    def _set_usage(self, key_id: str, used: int) -> None:
        if used > 0:
            self._usage[key_id] = used
        else:
            self._usage.pop(key_id, None)

    def _live(self, record: StoredResponse, key_id: str) -> bool:
        if record.deleted or record.key_id != key_id:
            return False
        ttl = self.limits.ttl_s
        return not ttl or record.created_at + ttl > self._clock()


def _row(record: StoredResponse) -> tuple[object, ...]:
    return (
        record.response_id,
        record.key_id,
        record.created_at,
        record.response_json,
        record.input_json,
        record.deleted_at,
        record.previous_id,
        record.depth,
        record.size,
    )


def _stored(row: asyncpg.Record) -> StoredResponse:
    response_id, key_id, created_at, response_json, input_json, deleted_at, previous, depth, _ = row
    return StoredResponse(
        str(response_id),
        str(key_id),
        int(created_at),
        bytes(response_json),
        bytes(input_json),
        None if previous is None else str(previous),
        int(depth),
        int(deleted_at),
    )
