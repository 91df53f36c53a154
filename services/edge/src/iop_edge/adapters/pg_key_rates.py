"""``KeyRateStore`` in PostgreSQL: a key's rates and budget hold across every edge of a
fleet (docs/ARCHITECTURE.md#limits-per-key).

A count is a row (key, scope, kind, slot, amount): a second's requests or tokens of a
rate, or a budget period's tokens. Admission is one transaction: an advisory lock per
key (so two edges' admissions of one key take turns, and only those), the key's rows
of the last minute and its budget rows read, ``domain.key_rates.admit`` decides, and
its amounts are added. Times are the server's clock (``clock_timestamp()``): edges'
clocks never compare. Requests and input estimates are exact across edges.

Tokens counted after admission (a stream's output, the estimate corrected at the end)
are only added, never checked, so they need no lock and no read: each edge gathers
them and adds them every ``FLUSH_S`` in one statement, off the request's path. The
tolerance across edges: a key's other edges see its output tokens up to ``FLUSH_S``
late (at a limit of N output tokens a minute, N/60 * FLUSH_S tokens per edge; the
stream counted as it goes, 16 tokens at a time, ``key_rates.COUNT_EVERY``).

While the store cannot be reached inference goes on: each edge counts a key in its
own memory against its share of each limit, ``limit // live edges`` (the edges that
renewed their presence within ``PRESENCE_TTL_S`` when it last could ask), and asks the
store again after ``RETRY_S``. What was counted meanwhile stays this edge's; a budget
is counted from zero on the fallback, so an outage can let a key use up to its share
of the budget again (said in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Final, Self

import asyncpg
from loguru import logger

from iop_edge.domain import key_rates
from iop_edge.domain.fleet import KeyLimits
from iop_edge.domain.key_rates import Gauge, Refusal, Scopes
from iop_edge.service.memory_key_rates import MemoryKeyRates
from iop_proto.postgres import StorageUnavailable, apply_migrations, reachable
from iop_proto.tasks import cancel_and_wait

COMPONENT: Final = "edge_key_rates"
STEPS: Final = (
    """
    CREATE TABLE iop_key_rates (
        key_id TEXT NOT NULL,
        scope TEXT NOT NULL,
        kind TEXT NOT NULL,
        slot BIGINT NOT NULL,
        amount DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (key_id, scope, kind, slot)
    );
    CREATE TABLE iop_key_rate_edges (
        edge_id TEXT PRIMARY KEY,
        expires_at TIMESTAMPTZ NOT NULL
    );
    """,
)
FLUSH_S: Final = 0.5
"""How often the tokens counted after admission are added to the store."""
RETRY_S: Final = 5.0
"""How long an edge counts on its own after the store failed, before asking it again."""
PRESENCE_TTL_S: Final = 15.0
STATEMENT_TIMEOUT_S: Final = 2.0
ADMIT_TIMEOUT_S: Final = 10.0
"""Longer than one statement: a key's admissions queue behind its advisory lock, so a
burst of N requests of one key waits N round trips, and a timeout that tripped on that
would put a healthy store's edge on its fallback (each edge then counting its share
alone, on top of what the store already admitted)."""
_ADD: Final = """
    INSERT INTO iop_key_rates (key_id, scope, kind, slot, amount)
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::float8[])
    ON CONFLICT (key_id, scope, kind, slot)
    DO UPDATE SET amount = iop_key_rates.amount + EXCLUDED.amount
"""
_NOW: Final = "extract(epoch from clock_timestamp())::float8"

ScopesKey = tuple[tuple[str, KeyLimits], ...]


class PostgresKeyRates:
    """``KeyRateStore`` in the shared store; ``open`` it, ``aclose`` it."""

    def __init__(self, pool: asyncpg.Pool, edge_id: str) -> None:
        self._pool = pool
        self._edge = edge_id
        self._edges = 1  # live edges at the last renewal of this edge's presence
        self._fallback = MemoryKeyRates(share=lambda: self._edges)
        self._down_until = 0.0  # monotonic: counting on the fallback until then
        self._pending: dict[tuple[str, ScopesKey], list[int]] = {}  # -> [input, output]
        self._flusher: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, pool: asyncpg.Pool, edge_id: str) -> Self:
        await apply_migrations(pool, COMPONENT, STEPS)
        store = cls(pool, edge_id)
        with contextlib.suppress(StorageUnavailable):
            await store.renew_presence()
        store._flusher = asyncio.create_task(store._flush_forever(), name="key-rate-flush")
        return store

    async def admit(
        self, key_id: str, scopes: Scopes, input_tokens: int
    ) -> tuple[tuple[Gauge, ...], Refusal | None]:
        if time.monotonic() >= self._down_until:
            try:
                with reachable("admitting a limited key's request"):
                    async with asyncio.timeout(ADMIT_TIMEOUT_S):
                        return await self._admit(key_id, scopes, input_tokens)
            except StorageUnavailable as exc:
                self._lost(str(exc))
        return await self._fallback.admit(key_id, scopes, input_tokens)

    def charge(self, key_id: str, scopes: Scopes, input_tokens: int, output_tokens: int) -> None:
        if time.monotonic() < self._down_until:
            self._fallback.charge(key_id, scopes, input_tokens, output_tokens)
            return
        counted = self._pending.setdefault((key_id, tuple(scopes)), [0, 0])
        counted[0] += input_tokens
        counted[1] += output_tokens

    async def flush(self) -> None:
        """Add the tokens counted since the last flush; ``StorageUnavailable`` keeps them."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            with reachable("adding keys' tokens"):
                async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                    now = await self._pool.fetchval(f"SELECT {_NOW}")
                    rows: dict[tuple[str, str, str, int], float] = {}
                    for (key_id, scopes), (inputs, outputs) in pending.items():
                        for (scope, kind, slot), amount in key_rates.charge(
                            scopes, inputs, outputs, now
                        ).items():
                            row = (key_id, scope, kind, slot)
                            rows[row] = rows.get(row, 0.0) + amount
                    if rows:
                        await self._pool.execute(_ADD, *_columns(rows))
        except BaseException:
            for pending_key, (inputs, outputs) in pending.items():  # kept for the next flush
                counted = self._pending.setdefault(pending_key, [0, 0])
                counted[0] += inputs
                counted[1] += outputs
            raise

    async def aclose(self) -> None:
        if self._flusher is not None:
            await cancel_and_wait(self._flusher)
        with contextlib.suppress(StorageUnavailable):
            await self.flush()
            with reachable("leaving the key rates' edges"):
                async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                    await self._pool.execute(
                        "DELETE FROM iop_key_rate_edges WHERE edge_id = $1", self._edge
                    )

    async def _admit(
        self, key_id: str, scopes: Scopes, input_tokens: int
    ) -> tuple[tuple[Gauge, ...], Refusal | None]:
        async with self._pool.acquire() as conn, conn.transaction():
            now = await conn.fetchval(
                f"SELECT {_NOW} FROM (SELECT pg_advisory_xact_lock("
                "hashtext('iop_key_rates'), hashtext($1))) AS locked",
                key_id,
            )
            rows = await conn.fetch(
                "SELECT scope, kind, slot, amount FROM iop_key_rates WHERE key_id = $1"
                " AND (slot >= $2 OR kind = $3)",
                key_id,
                math.floor(now) - key_rates.WINDOW_S,
                key_rates.BUDGET,
            )
            counts = {(r["scope"], r["kind"], r["slot"]): r["amount"] for r in rows}
            adds, refusal = key_rates.admit(counts, scopes, input_tokens, now)
            if adds:
                await conn.execute(
                    _ADD, *_columns({(key_id, *slot): amount for slot, amount in adds.items()})
                )
                for slot, amount in adds.items():
                    counts[slot] = counts.get(slot, 0.0) + amount
        return key_rates.gauges(counts, scopes, now), refusal

    async def renew_presence(self) -> None:
        """Say this edge is alive, and count the edges that are (each one's share of a
        limit while the store is down); ``StorageUnavailable`` when it cannot be reached."""
        with reachable("renewing the key rates' edges"):
            async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                edges = await self._pool.fetchval(
                    """
                    WITH renewed AS (
                        INSERT INTO iop_key_rate_edges (edge_id, expires_at)
                        VALUES ($1, now() + make_interval(secs => $2))
                        ON CONFLICT (edge_id) DO UPDATE SET expires_at = EXCLUDED.expires_at
                    )
                    SELECT count(*) + 1 FROM iop_key_rate_edges
                    WHERE expires_at > now() AND edge_id <> $1
                    """,
                    self._edge,
                    PRESENCE_TTL_S,
                )
        self._edges = max(1, int(edges))

    async def _prune(self) -> None:
        with reachable("dropping keys' expired counts"):
            async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                await self._pool.execute(
                    f"DELETE FROM iop_key_rates WHERE (kind <> $1 AND slot <= {_NOW} - $2)"
                    f" OR (kind = $1 AND slot < {_NOW} - $3)",
                    key_rates.BUDGET,
                    2 * key_rates.WINDOW_S,
                    key_rates.OLDEST_PERIOD_S,
                )
                await self._pool.execute("DELETE FROM iop_key_rate_edges WHERE expires_at < now()")

    def _lost(self, why: str) -> None:
        if time.monotonic() >= self._down_until:
            logger.warning(
                "key rates: {}; counting this edge's requests against its share of each"
                " key's limits (1/{}) for {} s (a budget counts from zero meanwhile)",
                why,
                self._edges,
                RETRY_S,
            )
        self._down_until = time.monotonic() + RETRY_S

    async def _flush_forever(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(FLUSH_S)
            rounds += 1
            try:
                down = time.monotonic() < self._down_until
                if down or rounds % round(PRESENCE_TTL_S / 3 / FLUSH_S) == 0:
                    await self.renew_presence()
                    if down:  # the store answers again: ask it from now on
                        logger.info("key rates: the shared store is back; limits hold across edges")
                        self._down_until = 0.0
                    await self._prune()
                await self.flush()
            except StorageUnavailable as exc:
                self._lost(str(exc))
            except Exception as exc:  # the loop outlives one bad round
                logger.opt(exception=exc).error("key rates: flush failed")


def _columns(
    rows: dict[tuple[str, str, str, int], float],
) -> tuple[list[str], list[str], list[str], list[int], list[float]]:
    keys, scopes, kinds, slots, amounts = [], [], [], [], []
    for (key_id, scope, kind, slot), amount in rows.items():
        keys.append(key_id)
        scopes.append(scope)
        kinds.append(kind)
        slots.append(slot)
        amounts.append(amount)
    return keys, scopes, kinds, slots, amounts
