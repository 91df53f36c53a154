"""Stored Responses API answers in one SQLite file, written by one background task in batches.

A response is kept when its run ends, on the request's path, so ``keep`` only
queues it (``iop_proto.sqlite.BatchedWriter``, the run log's writer too); a
read looks at what is still in memory first, so a follow-up request with
``previous_response_id`` sent the moment the answer arrived finds it. A
deletion is the same row written again as a tombstone (``deleted``, its
contents dropped), so it goes through the same queue in order.

Durability as for the run log: what is still in memory when the process is
killed is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loguru import logger

from iop_edge.ports import StoredResponse
from iop_proto.sqlite import BatchedWriter, WriterTuning, open_database

SCHEMA_VERSION = 1
_COLUMNS = ("response_id", "key_id", "created_at", "response_json", "input_json", "deleted")
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS responses (
        response_id   TEXT PRIMARY KEY,
        key_id        TEXT NOT NULL,
        created_at    INTEGER NOT NULL,
        response_json BLOB NOT NULL,
        input_json    BLOB NOT NULL,
        deleted       INTEGER NOT NULL DEFAULT 0
    )""",
)
_INSERT = (
    f"INSERT OR REPLACE INTO responses ({', '.join(_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(_COLUMNS))})"
)
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM responses WHERE response_id = ?"
BUSY_TIMEOUT_S = 5.0


class ResponseStoreError(Exception):
    """The response store cannot be used (a schema from a newer edge, a stopped writer)."""


class ResponseStoreClosed(ResponseStoreError, RuntimeError):
    """The store was used after ``aclose()``."""


class SqliteResponseStore(BatchedWriter[StoredResponse]):
    """A ``ResponseStore`` on one aiosqlite connection; make it with ``await open(path)``."""

    what = "response store"
    noun = "stored response"
    statement = _INSERT
    error = ResponseStoreError
    closed_error = ResponseStoreClosed

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        flush_interval_s: float = 0.25,
        max_batch: int = 200,
        max_pending: int = 10_000,
        retry_delay_s: float = 0.5,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> SqliteResponseStore:
        """Open (creating it owner-only if needed) the store at ``path``; ``aclose()`` it."""
        tuning = WriterTuning(flush_interval_s, max_batch, max_pending, retry_delay_s)
        db = await open_database(
            path,
            busy_timeout_s=busy_timeout_s,
            what="response store",
            owner="edge",
            schema=_SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="NORMAL",
            error=ResponseStoreError,
        )
        store = cls(db, path, tuning)
        store.start("edge-response-store-writer")
        logger.info("response store {}: opened", path)
        return store

    def keep(self, response: StoredResponse) -> None:
        """Queue a response or a tombstone; returns without waiting for the disk."""
        self.put(response)

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        self.check_open()
        memory = [r for r in self.unwritten() if r.response_id == response_id]
        rows = await self._db.execute_fetchall(_SELECT, (response_id,))
        found = self.latest((_stored(row) for row in rows), memory)
        if not found or found[0].deleted or found[0].key_id != key_id:
            return None
        return found[0]

    def _key(self, record: StoredResponse) -> str:
        return record.response_id

    def _row(self, record: StoredResponse) -> tuple[object, ...]:
        return (
            record.response_id,
            record.key_id,
            record.created_at,
            record.response_json,
            record.input_json,
            int(record.deleted),
        )


def _stored(row: Sequence[Any]) -> StoredResponse:
    response_id, key_id, created_at, response_json, input_json, deleted = row
    return StoredResponse(
        str(response_id),
        str(key_id),
        int(created_at),
        bytes(response_json),
        bytes(input_json),
        bool(deleted),
    )
