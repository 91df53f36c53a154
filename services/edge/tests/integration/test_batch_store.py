"""The batch store against real storage: contents streamed, kept consistent, migrated.

On SQLite a file's content lives beside the database (``<db>.files/``), its row
in SQLite; on PostgreSQL both are rows (contents as chunks). The tests that take
``store`` run on both backends (``batch_backend``); the rest are SQLite's own.
They read what is stored with their own eyes (``os.stat``, a raw ``sqlite3``
connection, the backend's rows) and measure with ``tracemalloc`` what an upload
and a download hold in memory.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import stat
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.batch_files import ContentDir
from iop_edge.adapters.batch_schema import SCHEMA_VERSION
from iop_edge.adapters.batch_store import SqliteBatchStore
from iop_edge.adapters.pg_batch_store import PostgresBatchStore
from iop_edge.domain.batches import FileRecord
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.errors import InvalidRequest, NotFound, StorageQuotaExceeded
from iop_edge.service.batches import BatchService

MIB = 1024 * 1024
CHAT = "/v1/chat/completions"
KEY_A = ApiKeyEntry("key_a", "a", "hash-a", frozenset(), 0)
OPERATOR = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True)

# The version-1 schema, as edges before file ownership created it.
V1_SCHEMA = (
    """CREATE TABLE files (id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
        bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL)""",
    """CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
        input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL,
        metadata TEXT, status TEXT NOT NULL, created_at INTEGER NOT NULL,
        in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
        expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
        expires_at INTEGER NOT NULL, output_file_id TEXT, error_file_id TEXT, errors TEXT,
        total_lines INTEGER NOT NULL, lease_id TEXT UNIQUE, lease_owner TEXT,
        lease_expires_at REAL, finalize_as TEXT)""",
    "CREATE INDEX batches_status ON batches (status, seq)",
    """CREATE TABLE batch_lines (batch_id TEXT NOT NULL, line_number INTEGER NOT NULL,
        custom_id TEXT NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL, status_code INTEGER,
        response TEXT, error TEXT, request_id TEXT, result_id TEXT, finished_at INTEGER,
        PRIMARY KEY (batch_id, line_number)) WITHOUT ROWID""",
    "CREATE INDEX batch_lines_state ON batch_lines (batch_id, state, line_number)",
)


class Unused:
    """The service's run and catalog ports: nothing here runs a line."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"unexpected call: {name}")


Backend = Any  # conftest's BatchBackend (a conftest cannot be imported)
Store = SqliteBatchStore | PostgresBatchStore


@pytest.fixture
async def store(batch_backend: Backend) -> AsyncIterator[Store]:
    opened = await batch_backend.open()
    try:
        yield opened
    finally:
        await opened.aclose()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SqliteBatchStore]:
    opened = await SqliteBatchStore.open(tmp_path / "state" / "batches.db")
    try:
        yield opened
    finally:
        await opened.aclose()


async def read_all(handle: Any) -> bytes:
    """A stored content read to its end, off the event loop (as the port requires)."""
    with handle:
        return bytes(await asyncio.to_thread(handle.read))


def service(store: Store, max_file_bytes: int = 64 * MIB) -> BatchService:
    return BatchService(
        store, Unused(), Unused(), CollectorRegistry(), max_file_bytes=max_file_bytes
    )


def record(file_id: str, size: int, owner: str | None = "key_a") -> FileRecord:
    return FileRecord(file_id, "in.jsonl", "batch", size, 1, owner)


def file_id(n: int) -> str:
    return f"file-{n:032x}"


async def test_an_upload_reaches_the_disk_as_it_arrives_and_exists_only_once_stored(
    sqlite_store: SqliteBatchStore,
) -> None:
    store = sqlite_store
    upload = await store.begin_upload(file_id(1))
    partial = store.contents.partial_path(file_id(1))
    await upload.write(b"a" * 100_000)
    await upload.write(b"b" * 50_000)
    assert partial.stat().st_size == 150_000  # on disk already, not held back
    assert await store.get_file(file_id(1)) is None
    await upload.commit(record(file_id(1), 150_000))
    assert not partial.exists()
    stored = store.contents.content_path(file_id(1))
    assert stored.read_bytes() == b"a" * 100_000 + b"b" * 50_000
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.contents.path.stat().st_mode) == 0o700
    assert store.contents.path == store.path.with_suffix(".files")
    assert await store.get_file(file_id(1)) == record(file_id(1), 150_000)


async def test_an_upload_past_the_limit_is_refused_at_once_and_leaves_nothing(
    store: Store, batch_backend: Backend
) -> None:
    batches = service(store, max_file_bytes=2500)
    written: list[int] = []

    async def send() -> None:
        async with batches.receive_file() as upload:
            for _ in range(10):
                await upload.write(b"x" * 1000)
                written.append(upload.size)

    with pytest.raises(InvalidRequest) as caught:
        await send()
    assert caught.value.param == "file"
    assert written == [1000, 2000]  # the third chunk passed the limit: nothing more was read
    assert await batch_backend.leftovers(store) == []
    assert await store.list_files(None, None, None, 10, True) == []


async def test_an_upload_not_stored_leaves_nothing(store: Store, batch_backend: Backend) -> None:
    batches = service(store)

    async def send() -> None:
        async with batches.receive_file() as upload:
            await upload.write(b"{}\n")
            await batches.create_file(upload, "x.jsonl", "fine-tune")

    with pytest.raises(InvalidRequest):
        await send()
    assert await batch_backend.leftovers(store) == []


async def test_upload_and_download_hold_a_chunk_not_the_file(store: Store) -> None:
    batches = service(store)
    tracemalloc.start()
    try:
        async with batches.receive_file() as upload:
            for n in range(32):
                await upload.write(bytes([n]) * MIB)
            created = await batches.create_file(upload, "big.jsonl", "batch", key=KEY_A)
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        content = await batches.file_content(created["id"], key=KEY_A)
        sizes = [len(chunk) async for chunk in content.chunks()]
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert created["bytes"] == 32 * MIB
    assert sum(sizes) == 32 * MIB
    assert max(sizes) <= MIB
    assert upload_peak < 6 * MIB, upload_peak  # the whole file would be 32 MiB (64 joined)
    assert download_peak < 6 * MIB, download_peak


async def test_creating_a_batch_reads_its_file_a_line_at_a_time(store: Store) -> None:
    batches = service(store)
    body = {"model": "m", "messages": [{"role": "user", "content": "z" * 2000}]}
    lines = [
        json.dumps({"custom_id": f"r{n}", "method": "POST", "url": CHAT, "body": body}).encode()
        for n in range(10_000)
    ]
    async with batches.receive_file() as upload:
        for start in range(0, len(lines), 1000):
            await upload.write(b"\n".join(lines[start : start + 1000]) + b"\n")
        created = await batches.create_file(upload, "in.jsonl", "batch")
    size = created["bytes"]
    del lines
    tracemalloc.start()
    try:
        batch = await batches.create_batch(created["id"], CHAT, "24h", None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch["request_counts"]["total"] == 10_000
    assert size > 19 * MIB
    assert peak < 8 * MIB, peak  # custom ids and line numbers, not the 20 MB of requests
    assert (await store.get_line(batch["id"], 9_999)) is not None


async def test_a_download_in_progress_survives_a_delete(
    store: Store, batch_backend: Backend
) -> None:
    batches = service(store)
    async with batches.receive_file() as upload:
        await upload.write(b"1" * (3 * MIB))
        created = await batches.create_file(upload, "in.jsonl", "batch")
    content = await batches.file_content(created["id"])
    chunks = content.chunks()
    first = await anext(chunks)
    await batches.delete_file(created["id"])
    rest = [chunk async for chunk in chunks]
    assert len(first) + sum(map(len, rest)) == 3 * MIB
    assert await batch_backend.content_removed(store, created["id"])
    with pytest.raises(NotFound):
        await batches.file_content(created["id"])


async def test_what_a_crash_leaves_is_swept_when_the_store_opens(tmp_path: Path) -> None:
    path = tmp_path / "batches.db"
    store = await SqliteBatchStore.open(path)
    kept = await store.begin_upload(file_id(1))
    await kept.write(b"kept")
    await kept.commit(record(file_id(1), 4))
    await store.aclose()
    contents = ContentDir.beside(path)
    contents.partial_path(file_id(2)).write_bytes(b"an upload the crash cut short")
    contents.content_path(file_id(3)).write_bytes(b"content whose row never committed")
    (contents.path / "notes.txt").write_text("not ours: left alone")

    reopened = await SqliteBatchStore.open(path)
    try:
        assert sorted(p.name for p in contents.path.iterdir()) == [file_id(1), "notes.txt"]
        handle = await reopened.open_content(file_id(1))
        assert handle is not None
        with handle:
            assert handle.read() == b"kept"
    finally:
        await reopened.aclose()


async def test_a_version_1_store_is_migrated_with_everything_owned_by_nobody(
    tmp_path: Path,
) -> None:
    path = tmp_path / "batches.db"
    raw = sqlite3.connect(path)
    for statement in V1_SCHEMA:
        raw.execute(statement)
    blob = b'{"custom_id": "old"}\n' * 1000
    raw.execute(
        "INSERT INTO files VALUES (?, 'old.jsonl', 'batch', ?, 5, ?)", (file_id(7), len(blob), blob)
    )
    raw.execute(
        """INSERT INTO batches (id, input_file_id, endpoint, completion_window, status,
        created_at, expires_at, total_lines) VALUES ('batch_old', ?, '/v1/chat/completions',
        '24h', 'completed', 5, 100, 0)""",
        (file_id(7),),
    )
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()

    store = await SqliteBatchStore.open(path)
    try:
        batches = service(store)
        assert await store.get_file(file_id(7)) == FileRecord(
            file_id(7), "old.jsonl", "batch", len(blob), 5, None
        )
        for key in (OPERATOR, None):
            content = await batches.file_content(file_id(7), key=key)
            assert b"".join([chunk async for chunk in content.chunks()]) == blob
            assert (await batches.get_batch("batch_old", key=key))["status"] == "completed"
        with pytest.raises(NotFound):
            await batches.get_file(file_id(7), key=KEY_A)
        with pytest.raises(NotFound):
            await batches.get_batch("batch_old", key=KEY_A)
        assert (await batches.list_batches(None, 10, key=KEY_A))["data"] == []
    finally:
        await store.aclose()
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        columns = [row[1] for row in raw.execute("PRAGMA table_info(files)")]
        assert columns == ["id", "filename", "purpose", "bytes", "created_at", "owner"]
        assert "owner" in [row[1] for row in raw.execute("PRAGMA table_info(batches)")]
    finally:
        raw.close()


async def test_files_expire_then_the_sweep_removes_them(batch_backend: Backend) -> None:
    now = [1000.0]
    store = await batch_backend.open(lambda: now[0], file_ttl_s=100)
    try:
        for n, created in ((1, 950), (2, 1000)):
            upload = await store.begin_upload(file_id(n))
            await upload.write(b"x" * 10)
            await upload.commit(FileRecord(file_id(n), "in.jsonl", "batch", 10, created, "key_a"))
        now[0] = 1050  # file 1 is 100 s old: expired, gone from reads at once
        assert await store.get_file(file_id(1)) is None
        assert await store.open_content(file_id(1)) is None
        listed = await store.list_files("key_a", None, None, 10, True)
        assert [f.id for f in listed] == [file_id(2)]
        assert await store.owned_bytes("key_a") == 20  # charged until the sweep
        assert await store.sweep_files() == 1
        assert await batch_backend.content_removed(store, file_id(1))
        assert await store.owned_bytes("key_a") == 10
        assert await store.get_file(file_id(2)) is not None
    finally:
        await store.aclose()


async def test_an_upload_past_the_key_s_quota_is_refused_as_it_arrives(store: Store) -> None:
    batches = BatchService(store, Unused(), Unused(), CollectorRegistry(), file_quota_bytes=2500)

    async def send(key: ApiKeyEntry, chunks: int) -> None:
        async with batches.receive_file(key=key) as upload:
            for _ in range(chunks):
                await upload.write(b"x" * 1000)
            await batches.create_file(upload, "in.jsonl", "batch", key=key)

    await send(KEY_A, 2)
    with pytest.raises(StorageQuotaExceeded) as caught:
        await send(KEY_A, 1)  # 3,000 bytes would pass 2,500
    assert (caught.value.status, caught.value.code) == (400, "storage_quota_exceeded")
    assert await store.owned_bytes("key_a") == 2000  # the refused upload left nothing
    await send(OPERATOR, 2)  # another owner's room
    other = ApiKeyEntry("key_b", "b", "hash-b", frozenset(), 0)
    await send(other, 2)
    files = await batches.list_files(None, None, 10, key=KEY_A)
    assert len(files["data"]) == 1
    await batches.delete_file(files["data"][0]["id"], key=KEY_A)
    await send(KEY_A, 2)  # deleting made room
