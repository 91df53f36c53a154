"""The PostgreSQL batch store as several edges share it, streams through it, and outlives
an outage of its server.

Two "edges" here are two pools and two ``BatchService``s on one real database
(the throwaway server of ``iop_proto.pytest_postgres``), racing with no lock in
common: what keeps a lease with one worker and a line finished once is the
store's conditional writes. The outage is the real server stopped and started.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from iop_edge.adapters.pg_batch_files import CHUNK_BYTES
from iop_edge.adapters.pg_batch_schema import COMPONENT, STEPS
from iop_edge.adapters.pg_batch_store import PostgresBatchStore
from iop_edge.domain.batches import LINE_FAILED, FileRecord, LineResult
from iop_edge.errors import LeaseLost
from iop_edge.service.batches import BatchService
from iop_proto.postgres import PostgresSettings, StorageUnavailable, apply_migrations, open_pool
from iop_proto.testing_postgres import PostgresServer

MIB = 1024 * 1024
CHAT = "/v1/chat/completions"
T0 = 1_750_000_000.0
TTL = 30.0


class Clock:
    """One fake clock both edges read (their hosts' clocks, in agreement)."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class NoModels:
    """A catalog with no model: every line fails (404) without a run, so the tests need
    no fleet, and what they count is the store's doing."""

    def model(self, model_id: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"unexpected call: {name}")


class NoRuns:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"unexpected call: {name}")


@dataclass
class Edge:
    pool: asyncpg.Pool
    store: PostgresBatchStore
    service: BatchService
    registry: CollectorRegistry
    clock: Clock

    def lines_stored(self) -> float:
        return (
            self.registry.get_sample_value("iop_edge_batch_lines_total", {"outcome": "failed"})
            or 0.0
        )


def settings(dsn: str) -> PostgresSettings:
    return PostgresSettings(dsn=SecretStr(dsn), max_connections=6, connect_timeout_s=15)


@pytest.fixture
async def edges(postgres_dsn: str) -> AsyncIterator[tuple[Edge, Edge]]:
    """Two edges on one database, started at once (their migrations meet at the lock)."""
    clock = Clock()
    pools = [await open_pool(settings(postgres_dsn)) for _ in range(2)]
    stores = await asyncio.gather(
        *(
            PostgresBatchStore.open(pool, clock=clock, edge_id=f"edge-{name}")
            for pool, name in zip(pools, "ab", strict=True)
        )
    )
    made = []
    for pool, store in zip(pools, stores, strict=True):
        registry = CollectorRegistry()
        service = BatchService(store, NoRuns(), NoModels(), registry, lease_ttl_s=TTL, clock=clock)
        made.append(Edge(pool, store, service, registry, clock))
    try:
        yield made[0], made[1]
    finally:
        for edge in made:
            await edge.store.aclose()
            await edge.pool.close()


def jsonl(count: int) -> bytes:
    lines = [
        {
            "custom_id": f"r{n}",
            "method": "POST",
            "url": CHAT,
            "body": {"model": "absent", "messages": [{"role": "user", "content": "hi"}]},
        }
        for n in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def new_batch(edge: Edge, count: int = 3) -> str:
    async with edge.service.receive_file() as upload:
        await upload.write(jsonl(count))
        file = await edge.service.create_file(upload, "in.jsonl", "batch")
    return str((await edge.service.create_batch(file["id"], CHAT, "24h", None))["id"])


async def test_a_lease_is_held_by_one_worker_at_a_time_across_two_edges(
    edges: tuple[Edge, Edge],
) -> None:
    a, b = edges
    batches = [await new_batch(a) for _ in range(10)]
    # Both edges ask at once, ten times: each batch is granted once, never to both.
    grants = []
    for _ in range(10):
        grants.extend(await asyncio.gather(a.service.lease("wa"), b.service.lease("wb")))
    granted = sorted(g.batch_id for g in grants if g.batch_id)
    assert granted == sorted(batches)
    assert len({g.lease_id for g in grants if g.lease_id}) == 10
    assert (await b.service.lease("wb")).batch_id == ""  # every lease is live

    first = next(g for g in grants if g.batch_id == batches[0])
    holder, other = (a, b) if await a.service.lease_holder(first.lease_id) == "wa" else (b, a)
    await holder.service.run_line(first.lease_id, 0)
    holder.clock.now += TTL + 1  # the worker went quiet (its edge may be gone)
    # Expired: the other edge takes the batch over (the oldest), at its first unfinished line.
    taken = await other.service.lease("w-other")
    assert (taken.batch_id, taken.next_line, taken.total_lines) == (batches[0], 1, 3)
    with pytest.raises(LeaseLost):
        await holder.service.renew(first.lease_id)  # not its lease any more
    assert await a.service.lease_holder(taken.lease_id) == "w-other"
    await holder.service.release(first.lease_id, finished=True)  # stale: changes nothing
    assert await b.service.lease_holder(taken.lease_id) == "w-other"


async def test_a_worker_registering_again_frees_only_the_leases_that_edge_granted(
    edges: tuple[Edge, Edge],
) -> None:
    """A worker dials every edge: registering with B (B restarted, say) must not free the
    lease A granted it on a connection that still lives."""
    a, b = edges
    first, second = await new_batch(a), await new_batch(a)
    via_a = await a.service.lease("w1")
    via_b = await b.service.lease("w1")
    assert (via_a.batch_id, via_b.batch_id) == (first, second)
    await b.service.worker_registered("w1")
    assert await a.service.lease_holder(via_a.lease_id) == "w1"  # A's grant: untouched
    assert await b.service.lease_holder(via_b.lease_id) is None  # B's own: freed
    await a.service.worker_registered("w1")
    assert await a.service.lease_holder(via_a.lease_id) is None
    assert (await b.service.lease("w2")).batch_id == first


async def test_the_store_grants_a_free_batch_once_to_concurrent_edges(
    edges: tuple[Edge, Edge],
) -> None:
    a, b = edges
    batch_id = await new_batch(a)
    tries = [
        store.set_lease(batch_id, f"lease_{n}", f"w{n}", T0 + TTL, T0)
        for n, store in enumerate([a.store, b.store] * 4)
    ]
    assert sorted(await asyncio.gather(*tries)) == [False] * 7 + [True]
    assert not await b.store.set_lease(batch_id, "lease_late", "w9", T0 + TTL, T0 + TTL - 1)
    assert await b.store.set_lease(batch_id, "lease_late", "w9", T0 + 2 * TTL, T0 + TTL)


async def test_a_line_run_on_both_edges_is_finished_exactly_once(
    edges: tuple[Edge, Edge],
) -> None:
    a, b = edges
    batch_id = await new_batch(a, count=20)
    grant = await a.service.lease("w1")
    assert grant.batch_id == batch_id
    # The worker's lease used through both edges at once (it dialed both), every line.
    replies = await asyncio.gather(
        *(edge.service.run_line(grant.lease_id, n) for n in range(20) for edge in (a, b))
    )
    assert [r.custom_id for r in replies] == [f"r{n // 2}" for n in range(40)]
    assert {r.status_code for r in replies} == {404}
    assert a.lines_stored() + b.lines_stored() == 20  # each line stored by one edge
    # The store's own answer: a second finish of a finished line is False.
    result = LineResult(LINE_FAILED, 500, None, "{}", "", "batch_req_x")
    again = await asyncio.gather(
        a.store.finish_line(batch_id, 0, result, 1), b.store.finish_line(batch_id, 0, result, 1)
    )
    assert again == [False, False]


async def test_concurrent_finishes_of_one_line_store_one(edges: tuple[Edge, Edge]) -> None:
    a, b = edges
    batch_id = await new_batch(a, count=30)
    results = [LineResult(LINE_FAILED, 500, None, f'{{"by": "{e}"}}', "", e) for e in "ab"]
    for index in range(30):
        won = await asyncio.gather(
            a.store.finish_line(batch_id, index, results[0], 1),
            b.store.finish_line(batch_id, index, results[1], 1),
        )
        assert sorted(won) == [False, True]
        line = await b.store.get_line(batch_id, index)
        assert line is not None
        assert line.result == results[won.index(True)]


async def test_a_batch_is_ended_once_when_both_edges_finalize_it(
    edges: tuple[Edge, Edge],
) -> None:
    a, b = edges
    batch_id = await new_batch(a)
    assert await a.store.begin_finalize(batch_id, "cancelled", 5)
    assert not await b.store.begin_finalize(batch_id, "expired", 6)  # frozen already
    result = LineResult(LINE_FAILED, 500, None, "{}", "", "r")
    assert not await b.store.finish_line(batch_id, 0, result, 6)  # frozen: takes no result
    files = [
        (FileRecord(f"file-{n:032x}", f"{n}.jsonl", "batch_output", 3, 5), b"e\n\n")
        for n in range(2)
    ]
    ended = await asyncio.gather(
        a.store.end_batch(batch_id, "cancelled", 5, None, files[0]),
        b.store.end_batch(batch_id, "cancelled", 5, None, files[1]),
    )
    assert sorted(ended) == [False, True]
    batch = await b.store.get_batch(batch_id)
    assert batch is not None
    assert batch.status == "cancelled"
    winner = files[ended.index(True)][0].id
    assert batch.error_file_id == winner
    outputs = await a.store.list_files(None, "batch_output", None, 10, True)
    assert [f.id for f in outputs] == [winner]  # the loser's file was never stored
    chunks = await a.pool.fetchval("SELECT COUNT(*) FROM edge_file_chunks")
    assert chunks == 2  # the input file's chunk and the winner's


async def test_a_64_mib_upload_streams_through_in_chunks_and_reads_back_identical(
    edges: tuple[Edge, Edge],
) -> None:
    a, b = edges
    sent = hashlib.sha256()
    tracemalloc.start()
    try:
        async with a.service.receive_file() as upload:
            for n in range(256):  # 64 MiB as an HTTP body arrives: 256 KiB at a time
                piece = hashlib.sha256(n.to_bytes(4, "big")).digest() * (256 * 1024 // 32)
                sent.update(piece)
                await upload.write(piece)
                del piece
            created = await a.service.create_file(upload, "big.jsonl", "batch")
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        content = await b.service.file_content(created["id"])  # the other edge reads it
        got = hashlib.sha256()
        sizes = []
        async for chunk in content.chunks():
            got.update(chunk)
            sizes.append(len(chunk))
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert created["bytes"] == 64 * MIB
    assert got.hexdigest() == sent.hexdigest()
    assert sum(sizes) == 64 * MIB
    assert max(sizes) <= MIB
    rows = await a.pool.fetchval(
        "SELECT COUNT(*) FROM edge_file_chunks WHERE file_id = $1", created["id"]
    )
    assert rows == 64 * MIB // CHUNK_BYTES
    assert upload_peak < 8 * MIB, upload_peak  # a chunk or two, never the 64 MiB
    assert download_peak < 8 * MIB, download_peak


async def test_an_upload_is_stored_as_it_arrives_and_exists_only_once_committed(
    edges: tuple[Edge, Edge],
) -> None:
    a, b = edges
    file_id = f"file-{1:032x}"
    upload = await a.store.begin_upload(file_id)
    await upload.write(b"a" * MIB)
    await upload.write(b"b" * (MIB // 2))
    written = await b.pool.fetchval(
        "SELECT SUM(octet_length(data)) FROM edge_file_chunks WHERE file_id = $1", file_id
    )
    assert written == MIB  # the full chunk is stored already; the half waits in memory
    assert await b.store.get_file(file_id) is None  # not a file before the commit
    assert await b.store.open_content(file_id) is None
    assert await b.store.list_files(None, None, None, 10, True) == []
    record = FileRecord(file_id, "in.jsonl", "batch", MIB + MIB // 2, 1, "key_a")
    await upload.commit(record)
    assert await b.store.get_file(file_id) == record
    handle = await b.store.open_content(file_id)
    assert handle is not None
    with handle:
        with pytest.raises(RuntimeError, match="off the event loop"):
            handle.read(10)  # on the loop's thread it would wait on itself
        data = await asyncio.to_thread(handle.read)
    assert data == b"a" * MIB + b"b" * (MIB // 2)


async def test_what_a_crash_left_is_purged_after_its_grace(edges: tuple[Edge, Edge]) -> None:
    a, b = edges
    clock = a.clock
    dead = await a.store.begin_upload(f"file-{2:032x}")  # its edge "crashes" mid-upload
    await dead.write(b"x" * (MIB + 1))
    kept = await a.store.begin_upload(f"file-{3:032x}")
    await kept.write(b"kept")
    await kept.commit(FileRecord(f"file-{3:032x}", "k.jsonl", "batch", 4, 1, None))
    assert await b.store.purge_contents() == 0  # the upload may still be going on
    clock.now += 3600
    assert await b.store.purge_contents() == 1
    remaining = await b.pool.fetch("SELECT DISTINCT file_id FROM edge_file_chunks")
    assert [row[0] for row in remaining] == [f"file-{3:032x}"]
    assert await b.store.delete_file(f"file-{3:032x}")
    assert await b.store.purge_contents() == 0  # deleted: readable for the grace
    clock.now += 3600
    assert await b.store.purge_contents() == 1
    assert await b.pool.fetchval("SELECT COUNT(*) FROM edge_file_chunks") == 0


async def test_batches_are_stored_from_big_files_with_a_pool_of_one_connection(
    postgres_dsn: str,
) -> None:
    """Storing a batch holds a transaction while its input file is read from a thread: the
    reading goes through that transaction's connection, never waits for a second one
    (with the pool's every connection held by such transactions, none would come)."""
    pool = await open_pool(PostgresSettings(dsn=SecretStr(postgres_dsn), max_connections=1))
    store = await PostgresBatchStore.open(pool)
    try:
        service = BatchService(store, NoRuns(), NoModels(), CollectorRegistry())
        content = jsonl(25_000)
        assert len(content) > 3 * MIB  # four chunks
        async with service.receive_file() as upload:
            await upload.write(content)
            file = await service.create_file(upload, "in.jsonl", "batch")
        async with asyncio.timeout(60):  # a reader waiting for the pool would wait 120 s
            made = await asyncio.gather(
                *(service.create_batch(file["id"], CHAT, "24h", None) for _ in range(3))
            )
        assert [m["request_counts"]["total"] for m in made] == [25_000] * 3
        line = await store.get_line(made[2]["id"], 24_999)
        assert line is not None
        assert line.custom_id == "r24999"
    finally:
        await store.aclose()
        await pool.close()


async def test_a_store_from_a_newer_edge_is_refused(postgres_dsn: str) -> None:
    pool = await open_pool(settings(postgres_dsn))
    try:
        await apply_migrations(pool, COMPONENT, (*STEPS, "SELECT 1"))
        with pytest.raises(RuntimeError, match="newer than this release"):
            await PostgresBatchStore.open(pool)
    finally:
        await pool.close()


async def test_an_outage_is_storage_unavailable_and_nothing_committed_is_lost(
    edges: tuple[Edge, Edge], postgres_server: PostgresServer
) -> None:
    a, b = edges
    batch_id = await new_batch(a)
    grant = await a.service.lease("w1")
    await a.service.run_line(grant.lease_id, 0)
    async with a.service.receive_file() as upload:
        await upload.write(b"z" * (2 * MIB + 5))
        stored = await a.service.create_file(upload, "z.jsonl", "batch")
    reading = await b.service.file_content(stored["id"])
    chunks = reading.chunks()
    assert len(await anext(chunks)) == MIB

    await asyncio.to_thread(postgres_server.down)
    try:
        calls = {
            "get_file": b.service.get_file(stored["id"]),
            "list_files": b.service.list_files(None, None, 10),
            "get_batch": b.service.get_batch(batch_id),
            "upload": b.store.begin_upload(f"file-{9:032x}"),
            "lease": b.service.lease("w2"),
            "renew": a.service.renew(grant.lease_id),
            "run_line": a.service.run_line(grant.lease_id, 1),
            "download": anext(chunks),  # a download in progress: its next chunk
        }
        answered = []
        for name, call in calls.items():
            try:
                await call
            except StorageUnavailable:
                continue
            answered.append(name)
        assert answered == []  # each one: a retryable StorageUnavailable, not an answer
    finally:
        await asyncio.to_thread(postgres_server.up)

    # Back: everything committed is there, and the edges work again.
    assert (await b.service.get_file(stored["id"]))["bytes"] == 2 * MIB + 5
    again = await a.service.file_content(stored["id"])
    assert b"".join([c async for c in again.chunks()]) == b"z" * (2 * MIB + 5)
    renewed = await a.service.renew(grant.lease_id)
    assert (renewed.batch_id, renewed.next_line) == (batch_id, 1)
    for n in (1, 2):
        await b.service.run_line(grant.lease_id, n)
    await b.service.release(grant.lease_id, finished=True)
    # Restarted between operations, while the edges run (their loops see the connections
    # close): the pools reconnect and the next calls work.
    await asyncio.to_thread(postgres_server.restart)
    done = await a.service.get_batch(batch_id)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    errors = await a.service.file_content(done["error_file_id"])
    lines = b"".join([c async for c in errors.chunks()]).decode().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == ["r0", "r1", "r2"]
