"""The edge's store of Responses API answers against real database files."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from iop_edge.adapters.sqlite_responses import ResponseStoreClosed, SqliteResponseStore
from iop_edge.ports import StoredResponse


def stored(response_id: str, key_id: str = "key_a", *, deleted: bool = False) -> StoredResponse:
    return StoredResponse(
        response_id, key_id, 1_800_000_000, b'{"id":"%s"}' % response_id.encode(), b"[]", deleted
    )


async def test_a_kept_response_reads_back_before_and_after_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.db"
    store = await SqliteResponseStore.open(path, flush_interval_s=60)
    try:
        store.keep(stored("resp_1"))
        assert await store.get("resp_1", "key_a") == stored("resp_1")  # still in memory
        await store.flush()
        assert store.writes == 1
        assert await store.get("resp_1", "key_a") == stored("resp_1")  # from the file
        assert await store.get("resp_1", "key_b") is None  # another key's: not found
        assert await store.get("resp_2", "key_a") is None
    finally:
        await store.aclose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # clients' conversations: owner only
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    reopened = await SqliteResponseStore.open(path)
    try:
        assert await reopened.get("resp_1", "key_a") == stored("resp_1")
        reopened.keep(stored("resp_1", deleted=True))
        assert await reopened.get("resp_1", "key_a") is None  # the tombstone, in memory
        await reopened.flush()
        assert await reopened.get("resp_1", "key_a") is None  # and on disk
    finally:
        await reopened.aclose()


async def test_a_closed_store_refuses_use(tmp_path: Path) -> None:
    store = await SqliteResponseStore.open(tmp_path / "responses.db")
    await store.aclose()
    with pytest.raises(ResponseStoreClosed):
        store.keep(stored("resp_1"))
    with pytest.raises(ResponseStoreClosed):
        await store.get("resp_1", "key_a")
