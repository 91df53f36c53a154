"""API keys' concurrency limits held across edges by a real PostgreSQL
(docs/ARCHITECTURE.md#limits-and-affinity-across-edges): two stores on one database
are two edges; an edge killed with SIGKILL frees its slots after the TTL; with the
server down each edge serves on its share of the limit, and the slots it took then are
counted once the server is back."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from pydantic import SecretStr

from iop_edge.adapters.pg_key_slots import PostgresKeyConcurrency
from iop_edge.ports import KeySlot
from iop_proto.postgres import PostgresSettings, open_pool
from iop_proto.testing_postgres import PostgresServer

LIMIT = 4
WAIT_S = 30.0


@contextlib.asynccontextmanager
async def edge(
    dsn: str, edge_id: str, ttl_s: float = 30.0
) -> AsyncIterator[PostgresKeyConcurrency]:
    pool = await open_pool(PostgresSettings(dsn=SecretStr(dsn), connect_timeout_s=2))
    try:
        store = await PostgresKeyConcurrency.open(pool, edge_id, ttl_s)
        try:
            yield store
        finally:
            await store.aclose()
    finally:
        await pool.close()


async def granted(store: PostgresKeyConcurrency, count: int, key: str = "k") -> list[KeySlot]:
    """``count`` acquires of ``key`` at once; the slots given."""
    answers = await asyncio.gather(*(store.acquire(key, LIMIT) for _ in range(count)))
    return [slot for slot in answers if slot is not None]


async def rows(dsn: str, key: str = "k") -> int:
    connection = await asyncpg.connect(dsn)
    try:
        count = await connection.fetchval(
            "SELECT count(*) FROM iop_key_slots WHERE key_id = $1 AND expires_at > now()", key
        )
        return int(count)
    finally:
        await connection.close()


async def test_two_edges_hold_a_key_to_its_limit_and_a_release_frees_a_slot(
    postgres_dsn: str,
) -> None:
    async with edge(postgres_dsn, "edge-a") as a, edge(postgres_dsn, "edge-b") as b:
        first_a, first_b = await asyncio.gather(granted(a, 4), granted(b, 4))
        assert len(first_a) + len(first_b) == LIMIT  # 8 asked at once, 4 per edge
        assert await rows(postgres_dsn) == LIMIT
        # Full on both edges, whichever holds them; another key is not.
        assert await a.acquire("k", LIMIT) is None
        assert await b.acquire("k", LIMIT) is None
        assert await a.acquire("other", 1) is not None
        # One given back (on whichever edge held it) frees one slot, for either edge.
        holder, held = (a, first_a) if first_a else (b, first_b)
        await holder.release(held[0])
        await holder.release(held[0])  # a second release of the same slot changes nothing
        assert await rows(postgres_dsn) == LIMIT - 1
        taken = await b.acquire("k", LIMIT)
        assert taken is not None
        assert await a.acquire("k", LIMIT) is None
        for store, slots in ((a, first_a), (b, first_b)):
            for slot in slots:  # held[0] among them, given back already: nothing happens
                await store.release(slot)
        await b.release(taken)
        assert await rows(postgres_dsn) == 0


async def test_an_edge_that_starts_again_drops_what_its_previous_life_held(
    postgres_dsn: str,
) -> None:
    async with edge(postgres_dsn, "edge-a") as a:
        assert len(await granted(a, 3)) == 3
        pool = await open_pool(PostgresSettings(dsn=SecretStr(postgres_dsn)))
        try:
            # The same edge id starting again (its process restarted) clears its rows.
            again = await PostgresKeyConcurrency.open(pool, "edge-a", 30.0)
            assert await rows(postgres_dsn) == 0
            await again.aclose()
        finally:
            await pool.close()


HOLDER = """
import asyncio, sys
from pydantic import SecretStr
from iop_edge.adapters.pg_key_slots import PostgresKeyConcurrency
from iop_proto.postgres import PostgresSettings, open_pool

async def main():
    pool = await open_pool(PostgresSettings(dsn=SecretStr(sys.argv[1])))
    store = await PostgresKeyConcurrency.open(pool, "edge-killed", float(sys.argv[2]))
    held = [await store.acquire("k", 4) for _ in range(4)]
    print(sum(slot is not None for slot in held), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_edge_s_slots_free_themselves_after_the_ttl(postgres_dsn: str) -> None:
    ttl_s = 2.0
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, postgres_dsn, str(ttl_s), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), WAIT_S)
        assert line.strip() == b"4"  # the other edge took the key's four slots
        async with edge(postgres_dsn, "edge-b", ttl_s) as b:
            # Renewed while it lives: several TTLs on, its four still fill the key.
            deadline = time.monotonic() + 3 * ttl_s
            while time.monotonic() < deadline:
                assert await b.acquire("k", LIMIT) is None
                await asyncio.sleep(0.2)
            holder.send_signal(signal.SIGKILL)
            await asyncio.wait_for(holder.wait(), WAIT_S)
            killed_at = time.monotonic()
            slots: list[KeySlot] = []
            async with asyncio.timeout(WAIT_S):
                while len(slots) < LIMIT:
                    slot = await b.acquire("k", LIMIT)
                    if slot is None:
                        await asyncio.sleep(0.1)
                    else:
                        slots.append(slot)
            # Not before the killed edge's last renewal ran out (a third of the TTL before
            # the kill at the earliest).
            assert time.monotonic() - killed_at >= ttl_s * 2 / 3 - 0.2
            assert await b.acquire("k", LIMIT) is None  # and then the limit holds again
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def test_with_the_server_down_each_edge_serves_its_share_then_counts_it_when_back(
    postgres_server: PostgresServer,
) -> None:
    dsn = postgres_server.create_database()
    async with edge(dsn, "edge-a") as a, edge(dsn, "edge-b") as b:
        await a.renew()  # a saw b's first renewal: two edges alive
        assert a.live_edges == 2
        postgres_server.down()
        try:
            # Inference goes on: each edge grants its share, 4 // 2, and refuses past it.
            async with asyncio.timeout(WAIT_S):
                during = [await a.acquire("k", LIMIT) for _ in range(3)]
            assert [slot is not None for slot in during] == [True, True, False]
            assert a.unreachable
            await a.release(during[0])  # given back while down: forgotten at once here
            again = await a.acquire("k", LIMIT)
            assert again is not None
        finally:
            postgres_server.up()
        async with asyncio.timeout(WAIT_S):
            while True:  # the pool's connections come back with the server
                with contextlib.suppress(Exception):
                    await a.renew()
                    break
                await asyncio.sleep(0.2)
        assert not a.unreachable
        # The two slots a took while the server was down are in the store now.
        assert await rows(dsn) == 2
        assert len(await granted(b, 4)) == LIMIT - 2


@pytest.mark.parametrize("limit", [1, 3])
async def test_a_share_is_never_below_one_slot(postgres_server: PostgresServer, limit: int) -> None:
    dsn = postgres_server.create_database()
    async with edge(dsn, "edge-a") as a, edge(dsn, "edge-b"), edge(dsn, "edge-c"):
        await a.renew()
        assert a.live_edges == 3
        postgres_server.down()
        try:
            async with asyncio.timeout(WAIT_S):
                first = await a.acquire("k", limit)
                second = await a.acquire("k", limit)
        finally:
            postgres_server.up()
        # 1 // 3 and 3 // 3 both give one slot: a key is never shut out by the outage.
        assert first is not None
        assert second is None


async def test_a_request_that_leaves_while_its_slot_is_taken_leaves_none_behind(
    postgres_dsn: str,
) -> None:
    async with edge(postgres_dsn, "edge-a") as a:
        blocker = await asyncpg.connect(postgres_dsn)
        try:
            # Another edge's acquire of the same key holds the key's lock: a's waits on it.
            await blocker.execute(
                "SELECT pg_advisory_lock(hashtext('iop_key_slots'), hashtext('k'))"
            )
            taking = asyncio.create_task(a.acquire("k", LIMIT))
            async with asyncio.timeout(WAIT_S):
                while not await blocker.fetchval(  # noqa: ASYNC110 - the server's state
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ):
                    await asyncio.sleep(0.05)
            taking.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await taking
            await blocker.execute(
                "SELECT pg_advisory_unlock(hashtext('iop_key_slots'), hashtext('k'))"
            )
        finally:
            await blocker.close()
        await a.renew()
        assert await rows(postgres_dsn) == 0
        assert len(await granted(a, LIMIT + 1)) == LIMIT  # every slot still there to take
