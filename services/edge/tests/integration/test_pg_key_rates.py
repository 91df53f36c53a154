"""API keys' rates and budgets held across edges by a real PostgreSQL
(docs/ARCHITECTURE.md#limits-per-key): two stores on one database are two edges. Their
admissions of one key at once hold its requests per minute exactly; tokens counted
after admission reach the other edge within a flush; with the server down each edge
counts alone on its share, and asks the store again once it is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pydantic import SecretStr

from iop_edge.adapters.pg_key_rates import PostgresKeyRates
from iop_edge.domain.fleet import BudgetPeriod, KeyLimits
from iop_edge.domain.key_rates import BUDGET, OUTPUT, REQUESTS, Scopes, scopes_of
from iop_proto.postgres import PostgresSettings, open_pool
from iop_proto.testing_postgres import PostgresServer

WAIT_S = 30.0


@contextlib.asynccontextmanager
async def edge(dsn: str, edge_id: str) -> AsyncIterator[PostgresKeyRates]:
    pool = await open_pool(PostgresSettings(dsn=SecretStr(dsn), connect_timeout_s=2))
    try:
        store = await PostgresKeyRates.open(pool, edge_id)
        try:
            yield store
        finally:
            await store.aclose()
    finally:
        await pool.close()


async def admitted(store: PostgresKeyRates, scopes: Scopes, count: int) -> int:
    answers = await asyncio.gather(*(store.admit("k", scopes, 1) for _ in range(count)))
    return sum(1 for _, refusal in answers if refusal is None)


async def test_two_edges_admit_a_keys_requests_per_minute_between_them(postgres_dsn: str) -> None:
    scopes = scopes_of(KeyLimits(requests_per_minute=10), {}, "m")
    async with edge(postgres_dsn, "edge-a") as a, edge(postgres_dsn, "edge-b") as b:
        first, second = await asyncio.gather(admitted(a, scopes, 10), admitted(b, scopes, 10))
        assert first + second == 10  # 20 asked at once over two edges
        found, refusal = await a.admit("k", scopes, 1)
        assert refusal is not None
        assert refusal.kind == REQUESTS
        assert {g.kind: g.remaining for g in found} == {REQUESTS: 0}
        other = scopes_of(KeyLimits(requests_per_minute=10), {}, "m")
        assert (await b.admit("another", other, 1))[1] is None  # per key


async def test_tokens_counted_on_one_edge_hold_the_key_on_the_other(postgres_dsn: str) -> None:
    limits = KeyLimits(
        output_tokens_per_minute=100, token_budget=1000, budget_period=BudgetPeriod.DAY
    )
    scopes = scopes_of(limits, {}, "m")
    async with edge(postgres_dsn, "edge-a") as a, edge(postgres_dsn, "edge-b") as b:
        assert (await a.admit("k", scopes, 10))[1] is None
        a.charge("k", scopes, 5, 120)  # a stream past the limit, finished on edge a
        await a.flush()
        found, refusal = await b.admit("k", scopes, 10)
        assert refusal is not None
        assert refusal.kind == OUTPUT
        shown = {g.kind: g.remaining for g in found}
        assert shown == {OUTPUT: 0, BUDGET: 1000 - 10 - 5 - 120}


async def test_with_the_server_down_each_edge_counts_its_share_then_asks_again(
    postgres_server: PostgresServer,
) -> None:
    dsn = postgres_server.create_database()
    scopes = scopes_of(KeyLimits(requests_per_minute=6), {}, "m")
    async with edge(dsn, "edge-a") as a, edge(dsn, "edge-b"):
        await a.renew_presence()  # a saw b: two edges alive
        postgres_server.down()
        try:
            async with asyncio.timeout(WAIT_S):  # inference goes on, on a's share: 6 // 2
                during = [(await a.admit("k", scopes, 1))[1] is None for _ in range(4)]
            assert during == [True, True, True, False]
        finally:
            postgres_server.up()
        async with asyncio.timeout(WAIT_S):
            while True:  # the flush loop renews a's presence once the server answers
                if await admitted(a, scopes, 1) == 1:
                    break
                await asyncio.sleep(0.2)
        # Asked again: the store counts from what it holds (nothing from the outage).
        assert await admitted(a, scopes, 10) == 5
