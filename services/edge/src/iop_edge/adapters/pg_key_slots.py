"""API keys' requests in progress counted in the PostgreSQL store every edge shares, so a
key's ``max_concurrent`` holds across edges (docs/ARCHITECTURE.md#limits-and-affinity-across-edges).

A held slot is a row (slot, key, edge, expiry). Taking one is one statement: under an
advisory lock per key, count the key's unexpired rows and insert one if below the limit;
giving it back deletes the row. Each edge renews its rows' expiry every third of the TTL,
so the slots of an edge that dies (killed, partitioned) free themselves after the TTL, and
an edge that starts deletes what its previous life left. Expiries are the server's clock
(``now()``): edges' clocks never compare.

While the store cannot be reached the edge keeps serving: it counts its own requests
against its share of the limit, ``limit // live edges`` (at least one), the edges being
those that renewed within the TTL when it last could ask; so two edges cut off together
still hold a key to its limit, give or take the rounding. The next renewal that reaches
the store records the slots taken meanwhile and ends the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Final, Self

import asyncpg
from loguru import logger

from iop_edge.ports import KeySlot
from iop_proto.postgres import StorageUnavailable, apply_migrations, reachable
from iop_proto.tasks import cancel_and_wait

COMPONENT: Final = "edge_key_slots"
STEPS: Final = (
    """
    CREATE TABLE iop_key_slots (
        slot_id TEXT PRIMARY KEY,
        key_id TEXT NOT NULL,
        edge_id TEXT NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL
    );
    CREATE INDEX iop_key_slots_by_key ON iop_key_slots (key_id, expires_at);
    CREATE INDEX iop_key_slots_by_edge ON iop_key_slots (edge_id);
    CREATE TABLE iop_key_slot_edges (
        edge_id TEXT PRIMARY KEY,
        expires_at TIMESTAMPTZ NOT NULL
    );
    -- One round trip per request: the lock is the statement's transaction's. Rows are
    -- only inserted here, never deleted (expired ones are purged by the renewals), so
    -- taking a slot never waits on another edge's row locks.
    CREATE FUNCTION iop_take_key_slot(
        p_key TEXT, p_slot TEXT, p_edge TEXT, p_limit INTEGER, p_ttl_s DOUBLE PRECISION
    ) RETURNS BOOLEAN LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtext('iop_key_slots'), hashtext(p_key));
        IF (SELECT count(*) FROM iop_key_slots
            WHERE key_id = p_key AND expires_at > now()) >= p_limit THEN
            RETURN FALSE;
        END IF;
        INSERT INTO iop_key_slots (slot_id, key_id, edge_id, expires_at)
            VALUES (p_slot, p_key, p_edge, now() + make_interval(secs => p_ttl_s));
        RETURN TRUE;
    END $$;
    -- An edge's renewal: its presence, its slots' expiry (inserting those taken while
    -- the store was unreachable), the slots it gave back meanwhile, and a purge of rows
    -- long expired. Returns how many edges are alive.
    CREATE FUNCTION iop_renew_key_slots(
        p_edge TEXT, p_slots TEXT[], p_keys TEXT[], p_gone TEXT[], p_ttl_s DOUBLE PRECISION
    ) RETURNS INTEGER LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO iop_key_slot_edges (edge_id, expires_at)
            VALUES (p_edge, now() + make_interval(secs => p_ttl_s))
            ON CONFLICT (edge_id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
        DELETE FROM iop_key_slots WHERE slot_id = ANY(p_gone) AND edge_id = p_edge;
        INSERT INTO iop_key_slots (slot_id, key_id, edge_id, expires_at)
            SELECT s, k, p_edge, now() + make_interval(secs => p_ttl_s)
            FROM unnest(p_slots, p_keys) AS held(s, k)
            ON CONFLICT (slot_id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
        DELETE FROM iop_key_slots WHERE expires_at <= now() - make_interval(secs => p_ttl_s);
        DELETE FROM iop_key_slot_edges WHERE expires_at <= now();
        RETURN (SELECT count(*) FROM iop_key_slot_edges);
    END $$;
    """,
)

STATEMENT_TIMEOUT_S: Final = 2.0
"""The most taking or giving back a slot may wait for the store: one short statement.
Past it the request is counted on the fallback (it is never failed for the store)."""


class PostgresKeyConcurrency:
    """``KeyConcurrency`` in the shared store; ``open`` it, ``aclose`` it."""

    def __init__(self, pool: asyncpg.Pool, edge_id: str, ttl_s: float) -> None:
        self._pool = pool
        self._edge = edge_id
        self._ttl_s = ttl_s
        self._held: dict[str, str] = {}  # slot id -> key id: this edge's, renewed
        self._per_key: dict[str, int] = {}  # this edge's slots per key (the fallback's count)
        self._gone: set[str] = set()  # given back while the store could not be told
        self._edges = 1  # edges alive at the last renewal
        self._unreachable: str | None = None  # why the store is not asked now
        self._renewal: asyncio.Task[None] | None = None
        self._deletes: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, pool: asyncpg.Pool, edge_id: str, ttl_s: float) -> Self:
        """Migrate, drop this edge's rows from a previous life, renew once, start renewing."""
        await apply_migrations(pool, COMPONENT, STEPS)
        store = cls(pool, edge_id, ttl_s)
        with reachable("clearing this edge's key slots"):
            await pool.execute("DELETE FROM iop_key_slots WHERE edge_id = $1", edge_id)
        await store.renew()
        store._renewal = asyncio.create_task(store._renew_forever(), name="key-slot-renewal")
        return store

    @property
    def live_edges(self) -> int:
        return self._edges

    @property
    def unreachable(self) -> bool:
        """The store is not asked now (counting on the fallback share)."""
        return self._unreachable is not None

    async def acquire(self, key_id: str, limit: int) -> KeySlot | None:
        slot_id = secrets.token_hex(12)
        if self._unreachable is None:
            try:
                with reachable("taking a key slot"):
                    async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                        granted = await self._pool.fetchval(
                            "SELECT iop_take_key_slot($1, $2, $3, $4, $5)",
                            key_id,
                            slot_id,
                            self._edge,
                            limit,
                            self._ttl_s,
                        )
            except StorageUnavailable as exc:
                # A row the server inserted before the error is never renewed: it frees
                # itself after the TTL.
                self._lost(str(exc))
            except asyncio.CancelledError:
                # The request left while the store answered: if the row was inserted
                # anyway, the next renewal deletes it.
                self._gone.add(slot_id)
                raise
            else:
                return self._hold(key_id, slot_id) if granted else None
        if self._per_key.get(key_id, 0) >= max(1, limit // self._edges):
            return None
        return self._hold(key_id, slot_id)  # recorded by the renewal that reaches the store

    async def release(self, slot: KeySlot) -> None:
        if self._held.pop(slot.slot_id, None) is None:
            return  # given back already: once per slot
        left = self._per_key.get(slot.key_id, 0) - 1
        if left > 0:
            self._per_key[slot.key_id] = left
        else:
            self._per_key.pop(slot.key_id, None)
        if self._unreachable is not None:
            self._gone.add(slot.slot_id)
            return
        # Owned, and shielded: a second cancellation of the request cannot leave the row.
        task = asyncio.create_task(self._delete(slot.slot_id))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)
        await asyncio.shield(task)

    async def renew(self) -> None:
        """Extend this edge's slots by the TTL (and record those taken on the fallback);
        ``StorageUnavailable`` when the store cannot be reached."""
        held = dict(self._held)
        gone = list(self._gone)
        with reachable("renewing key slots"):
            async with asyncio.timeout(self._ttl_s / 3):
                edges = await self._pool.fetchval(
                    "SELECT iop_renew_key_slots($1, $2, $3, $4, $5)",
                    self._edge,
                    list(held),
                    list(held.values()),
                    gone,
                    self._ttl_s,
                )
            self._gone.difference_update(gone)
            # Given back while the renewal ran: its insert may have put them back.
            returned = [slot_id for slot_id in held if slot_id not in self._held]
            if returned:
                self._gone.update(returned)  # until this delete is done
                await self._pool.execute(
                    "DELETE FROM iop_key_slots WHERE slot_id = ANY($1::text[])", returned
                )
                self._gone.difference_update(returned)
        self._edges = max(1, int(edges))
        if self._unreachable is not None:
            logger.info("key slots: the shared store is back; limits hold across edges again")
            self._unreachable = None

    async def aclose(self) -> None:
        if self._renewal is not None:
            await cancel_and_wait(self._renewal)
        if self._deletes:
            await asyncio.gather(*self._deletes, return_exceptions=True)
        with contextlib.suppress(StorageUnavailable):
            with reachable("clearing this edge's key slots"):
                async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                    await self._pool.execute(
                        "DELETE FROM iop_key_slots WHERE edge_id = $1", self._edge
                    )

    def _hold(self, key_id: str, slot_id: str) -> KeySlot:
        self._held[slot_id] = key_id
        self._per_key[key_id] = self._per_key.get(key_id, 0) + 1
        return KeySlot(key_id, slot_id)

    async def _delete(self, slot_id: str) -> None:
        try:
            with reachable("giving back a key slot"):
                async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                    await self._pool.execute(
                        "DELETE FROM iop_key_slots WHERE slot_id = $1", slot_id
                    )
        except StorageUnavailable as exc:
            self._gone.add(slot_id)  # the next renewal deletes it; the TTL, at the latest
            self._lost(str(exc))

    def _lost(self, why: str) -> None:
        if self._unreachable is None:
            logger.warning(
                "key slots: {}; counting this edge's requests against its share of each"
                " key's limit (1/{} of it) until the store answers again",
                why,
                self._edges,
            )
        self._unreachable = why

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self.renew()
            except StorageUnavailable as exc:
                self._lost(str(exc))
            except Exception as exc:  # the loop outlives one bad round
                logger.opt(exception=exc).error("key slots: renewal failed")
