"""The edge's store of Responses API answers against real database files."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from iop_edge.adapters.sqlite_responses import (
    PURGE_GRACE_S,
    ResponseLimits,
    ResponseStoreClosed,
    SqliteResponseStore,
)
from iop_edge.errors import StorageQuotaExceeded
from iop_edge.ports import StoredResponse

T0 = 1_800_000_000


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


def turn(
    response_id: str, previous: StoredResponse | None = None, key_id: str = "key_a"
) -> StoredResponse:
    return StoredResponse(
        response_id,
        key_id,
        T0,
        b'{"id":"%s","output":[]}' % response_id.encode(),
        b'[{"id":"in_%s"}]' % response_id.encode(),
        None if previous is None else previous.response_id,
        0 if previous is None else previous.depth + 1,
    )


def rows_on_disk(path: Path) -> list[str]:
    """What another connection reads from the file: committed rows only."""
    with sqlite3.connect(path) as db:
        return [str(r[0]) for r in db.execute("SELECT response_id FROM responses ORDER BY 1")]


async def test_a_kept_turn_is_committed_when_keep_returns(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.db"
    store = await SqliteResponseStore.open(path, flush_interval_s=60)  # no coalescing wait
    try:
        await store.keep(turn("resp_1"))
        assert rows_on_disk(path) == ["resp_1"]  # on disk before the caller could answer
        assert await store.get("resp_1", "key_a") == turn("resp_1")
        assert await store.get("resp_1", "key_b") is None  # another key's: not found
        assert await store.get("resp_2", "key_a") is None
    finally:
        await store.aclose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # clients' conversations: owner only
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    reopened = await SqliteResponseStore.open(path)
    try:
        assert await reopened.get("resp_1", "key_a") == turn("resp_1")
        assert reopened.usage("key_a") == turn("resp_1").size
        assert await reopened.delete("resp_1", "key_a")
        assert await reopened.get("resp_1", "key_a") is None
        assert rows_on_disk(path) == []  # nothing continued it: its bytes are free at once
        assert reopened.usage("key_a") == 0
        assert not await reopened.delete("resp_1", "key_a")
    finally:
        await reopened.aclose()


async def test_a_conversation_is_its_chain_of_turns_each_stored_once(tmp_path: Path) -> None:
    clock = Clock()
    store = await SqliteResponseStore.open(tmp_path / "r.db", clock=clock)
    try:
        first = turn("resp_1")
        second = turn("resp_2", first)
        third = turn("resp_3", second)
        for each in (first, second, third):
            await store.keep(each)
        assert await store.chain("resp_3", "key_a") == [first, second, third]
        assert await store.chain("resp_3", "key_b") is None
        assert await store.chain("resp_9", "key_a") is None
        assert store.usage("key_a") == sum(t.size for t in (first, second, third))

        # Deleting a turn in the middle: it is gone, the turn after it still continues.
        assert await store.delete("resp_2", "key_a")
        assert await store.get("resp_2", "key_a") is None
        assert await store.chain("resp_2", "key_a") is None
        chain = await store.chain("resp_3", "key_a")
        assert chain is not None
        assert [t.response_id for t in chain] == ["resp_1", "resp_2", "resp_3"]
        clock.now += PURGE_GRACE_S + 1
        assert await store.sweep() == 0  # resp_3 still continues from it
        assert await store.delete("resp_3", "key_a")  # nothing continues it: gone at once
        assert rows_on_disk(tmp_path / "r.db") == ["resp_1", "resp_2"]
        clock.now += PURGE_GRACE_S + 1
        assert await store.sweep() == 1  # then the deleted middle it held
        assert await store.get("resp_1", "key_a") == first
        assert store.usage("key_a") == first.size
    finally:
        await store.aclose()


async def test_turns_expire_then_go_and_a_key_s_bytes_are_capped(tmp_path: Path) -> None:
    clock = Clock()
    limits = ResponseLimits(ttl_s=100, quota_bytes=200, max_depth=2)
    path = tmp_path / "r.db"
    store = await SqliteResponseStore.open(path, clock=clock, limits=limits)
    try:
        first = turn("resp_1")
        await store.keep(first)
        await store.keep(turn("resp_2", first))
        store.admit("key_a", 200 - 2 * first.size)
        with pytest.raises(StorageQuotaExceeded):
            store.admit("key_a", 200 - 2 * first.size + 20)
        store.admit("key_b", 200)  # a quota per key
        clock.now = T0 + 100
        assert await store.get("resp_1", "key_a") is None  # expired: not found
        assert await store.chain("resp_2", "key_a") is None
        assert await store.sweep() == 0  # the grace first
        clock.now = T0 + 100 + PURGE_GRACE_S
        assert await store.sweep() == 2
        assert rows_on_disk(path) == []
        assert store.usage("key_a") == 0
        store.admit("key_a", 200)
    finally:
        await store.aclose()


async def test_a_chain_is_read_no_deeper_than_its_bound(tmp_path: Path) -> None:
    limits = ResponseLimits(max_depth=3)
    store = await SqliteResponseStore.open(tmp_path / "r.db", limits=limits)
    try:
        links = [turn("resp_0")]
        for n in range(1, 6):
            links.append(turn(f"resp_{n}", links[-1]))
        for each in links:
            await store.keep(each)
        assert store.max_depth == 3
        assert await store.chain("resp_3", "key_a") == links[:4]
        assert await store.chain("resp_5", "key_a") is None  # past the bound: never read whole
    finally:
        await store.aclose()


async def test_a_version_1_file_reads_and_continues_as_before(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    with sqlite3.connect(path) as db:
        db.execute(
            """CREATE TABLE responses (response_id TEXT PRIMARY KEY, key_id TEXT NOT NULL,
            created_at INTEGER NOT NULL, response_json BLOB NOT NULL, input_json BLOB NOT NULL,
            deleted INTEGER NOT NULL DEFAULT 0)"""
        )
        db.execute(
            "INSERT INTO responses VALUES ('resp_old', 'key_a', ?, ?, ?, 0)",
            (T0, b'{"id":"resp_old"}', b'[{"id":"a"},{"id":"b"}]'),
        )
        db.execute(
            "INSERT INTO responses VALUES ('resp_gone', 'key_a', ?, ?, ?, 1)", (T0, b"{}", b"[]")
        )
        db.execute("PRAGMA user_version = 1")
    clock = Clock()
    store = await SqliteResponseStore.open(path, clock=clock)
    try:
        old = await store.get("resp_old", "key_a")
        assert old is not None
        assert (old.input_json, old.previous_id, old.depth) == (b'[{"id":"a"},{"id":"b"}]', None, 0)
        assert await store.get("resp_gone", "key_a") is None
        await store.keep(turn("resp_new", old))
        chain = await store.chain("resp_new", "key_a")
        assert chain is not None
        assert [t.response_id for t in chain] == ["resp_old", "resp_new"]
        assert store.usage("key_a") == old.size + 4 + turn("resp_new", old).size
        assert await store.sweep() == 1  # version 1's tombstone
    finally:
        await store.aclose()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2


async def test_a_closed_store_refuses_use(tmp_path: Path) -> None:
    store = await SqliteResponseStore.open(tmp_path / "responses.db")
    await store.aclose()
    with pytest.raises(ResponseStoreClosed):
        await store.keep(turn("resp_1"))
    with pytest.raises(ResponseStoreClosed):
        await store.get("resp_1", "key_a")
