"""Stored Responses API answers in one SQLite file: one row per turn, linked to the turn
it continues, committed before the answer leaves.

A turn keeps its own input items and its Response object, and names the turn it
continued (``previous_id``); a conversation is read back by walking those links
(one recursive query, bounded by ``max_depth``). So the file grows by what each
request brings, once: a chain of N turns costs N turns, not N²/2, and twenty
one-line requests continuing a 14 MiB conversation add twenty small rows.

Durability: ``keep`` and ``delete`` go through the shared batched writer's
``persist`` (``iop_proto.sqlite``) with ``synchronous = FULL``: they return once
the transaction holding the row has committed and its WAL frames are fsynced, so
what the API says it stored survives a crash of the process or of the machine.
Turns that arrive while a batch commits share the next commit. A read looks at
what is still in memory first (a turn being committed).

Lifetime: a turn expires ``ttl_s`` after it was made (OpenAI's 30 days by
default) and a deleted one at once: neither is found any more (404). The rows
themselves go in a sweep every ``sweep_interval_s``, ``PURGE_GRACE_S`` after
their end, once no turn that is still found continues from them: deleting or
outliving a turn in the middle of a conversation leaves the later turns working,
and their key is charged for the earlier turns' bytes until those go too. A
deleted turn nothing continues from goes at once (its bytes with it); a request
continuing it that was already running when it was deleted is stored, but its
own conversation cannot be read back any more (a 404 to continue it).
Each key's bytes are counted (``admit``) against ``quota_bytes``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import aiosqlite
from loguru import logger

from iop_edge.adapters.response_rows import (
    CHAIN,
    DEAD_UNREFERENCED,
    INSERT,
    REMOVE_UNCONTINUED,
    SCHEMA,
    SCHEMA_VERSION,
    SELECT,
    USAGE,
    check_quota,
    migrate,
)
from iop_edge.ports import StoredResponse
from iop_proto.sqlite import BatchedWriter, WriterTuning, open_database, transaction
from iop_proto.tasks import cancel_and_wait

BUSY_TIMEOUT_S: Final = 5.0
PURGE_GRACE_S: Final = 3600
"""How long a deleted or expired turn's row outlives its end: a request that read it
as its previous response just before (and whose turn is not stored yet) still finds
every turn of its conversation when it is stored."""
_PURGE_CHUNK: Final = 500
DAY_S: Final = 86_400


class ResponseStoreError(Exception):
    """The response store cannot be used (a schema from a newer edge, a stopped writer)."""


class ResponseStoreClosed(ResponseStoreError, RuntimeError):
    """The store was used after ``aclose()``."""


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseLimits:
    """What a key may keep, and for how long (the edge's ``storage`` settings)."""

    ttl_s: int = 30 * DAY_S  # 0: never expires
    quota_bytes: int = 0  # per key; 0: no quota
    max_depth: int = 1000  # turns a conversation may chain
    sweep_interval_s: float = 3600.0


class SqliteResponseStore(BatchedWriter[StoredResponse]):
    """A ``ResponseStore`` on one aiosqlite connection; make it with ``await open(path)``."""

    what = "response store"
    noun = "stored response"
    statement = INSERT
    error = ResponseStoreError
    closed_error = ResponseStoreClosed

    def __init__(
        self,
        db: aiosqlite.Connection,
        path: Path,
        tuning: WriterTuning,
        limits: ResponseLimits,
        clock: Callable[[], float],
    ) -> None:
        """Use ``open``."""
        super().__init__(db, path, tuning)
        self.limits = limits
        self.max_depth = limits.max_depth
        self.purged = 0  # rows removed by sweeps, for tests and logs
        self._clock = clock
        self._usage: dict[str, int] = {}  # bytes per key, every row still in the file
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        limits: ResponseLimits | None = None,
        clock: Callable[[], float] = time.time,
        flush_interval_s: float = 0.25,
        max_batch: int = 200,
        max_pending: int = 10_000,
        retry_delay_s: float = 0.5,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> SqliteResponseStore:
        """Open (creating or migrating, owner-only) the store at ``path``; ``aclose()`` it."""
        tuning = WriterTuning(flush_interval_s, max_batch, max_pending, retry_delay_s)
        db = await open_database(
            path,
            busy_timeout_s=busy_timeout_s,
            what="response store",
            owner="edge",
            schema=SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="FULL",  # acknowledged means on disk, power loss included
            error=ResponseStoreError,
            migrate=migrate,
        )
        store = cls(db, path, tuning, limits or ResponseLimits(), clock)
        try:
            for key_id, used in await db.execute_fetchall(USAGE):
                store._usage[str(key_id)] = int(used)
        except BaseException:
            await db.close()
            raise
        store.start("edge-response-store-writer")
        store._sweeper = asyncio.create_task(store._sweep_forever(), name="edge-response-sweep")
        logger.info("response store {}: opened", path)
        return store

    async def aclose(self, timeout_s: float = 5.0) -> None:
        sweeper, self._sweeper = self._sweeper, None
        await cancel_and_wait(sweeper)
        await super().aclose(timeout_s)

    # -- ResponseStore -------------------------------------------------------------

    def admit(self, key_id: str, incoming: int) -> None:
        check_quota(self._usage.get(key_id, 0), incoming, self.limits.quota_bytes)

    def usage(self, key_id: str) -> int:
        """The bytes ``key_id``'s rows take, as ``admit`` counts them."""
        return self._usage.get(key_id, 0)

    async def keep(self, response: StoredResponse) -> None:
        await self.persist(response)
        self._usage[response.key_id] = self._usage.get(response.key_id, 0) + response.size

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        self.check_open()
        memory = [r for r in self.unwritten() if r.response_id == response_id]
        rows = await self._db.execute_fetchall(SELECT, (response_id,))
        found = self.latest((_stored(row) for row in rows), memory)
        if not found or not self._live(found[0], key_id):
            return None
        return found[0]

    async def chain(self, response_id: str, key_id: str) -> list[StoredResponse] | None:
        self.check_open()
        memory = {r.response_id: r for r in self.unwritten()}  # newest change of each id last
        links: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None and current in memory and len(links) <= self.max_depth:
            links.append(memory[current])
            current = memory[current].previous_id
        if current is not None and len(links) <= self.max_depth:
            # A turn is committed no earlier than the one it continues: below the first
            # link on disk, every link is on disk (or a newer change of it in memory).
            rows = await self._db.execute_fetchall(CHAIN, (current, self.max_depth - len(links)))
            links.extend(memory.get(str(row[0]), _stored(row)) for row in rows)
        if not links or not self._live(links[0], key_id):
            return None
        if links[-1].previous_id is not None and len(links) > self.max_depth:
            return None  # longer than a conversation may be: not read whole
        if any(link.key_id != key_id for link in links) or links[-1].previous_id is not None:
            # A turn it continues was deleted while this one was running (see above).
            logger.warning("response store {}: {} continues a removed turn", self.path, response_id)
            return None
        links.reverse()
        return links

    async def delete(self, response_id: str, key_id: str) -> bool:
        found = await self.get(response_id, key_id)
        if found is None:
            return False
        # Committed as deleted first (a newer change than any still in memory), then the
        # row goes at once unless a later turn continues from it: then it stays, not
        # found, until the sweep finds nothing continuing from it.
        tombstone = dataclasses.replace(found, deleted_at=max(1, int(self._clock())))
        await self.persist(tombstone)
        if not any(r.previous_id == response_id for r in self.unwritten()):
            async with self._write_lock, transaction(self._db):
                cursor = await self._db.execute(REMOVE_UNCONTINUED, (response_id,))
                removed = cursor.rowcount > 0
            if removed:
                self._uncharge(found.key_id, found.size)
                self.purged += 1
        return True

    # -- the sweep -----------------------------------------------------------------

    async def sweep(self) -> int:
        """Remove the rows of turns over ``PURGE_GRACE_S`` past their end that no turn
        still found continues from; returns how many."""
        self.check_open()
        now = int(self._clock())
        ttl = self.limits.ttl_s
        params = {
            "deleted_before": now - PURGE_GRACE_S,
            "created_before": now - ttl - PURGE_GRACE_S if ttl else -1,
        }
        rows = await self._db.execute_fetchall(DEAD_UNREFERENCED, params)
        pinned = {r.previous_id for r in self.unwritten()} | {
            r.response_id for r in self.unwritten()
        }
        victims = [(str(i), str(k), int(b)) for i, k, b in rows if str(i) not in pinned]
        for start in range(0, len(victims), _PURGE_CHUNK):
            chunk = victims[start : start + _PURGE_CHUNK]
            async with self._write_lock, transaction(self._db):
                await self._db.executemany(
                    "DELETE FROM responses WHERE response_id = ?", [(i,) for i, _, _ in chunk]
                )
            for _, key_id, size in chunk:
                self._uncharge(key_id, size)
        self.purged += len(victims)
        if victims:
            logger.info("response store {}: {} ended turns removed", self.path, len(victims))
        return len(victims)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                logger.exception("response store {}: sweep failed; the next tries again", self.path)

    # -- internals -----------------------------------------------------------------

    def _uncharge(self, key_id: str, size: int) -> None:
        left = self._usage.get(key_id, 0) - size
        if left > 0:
            self._usage[key_id] = left
        else:
            self._usage.pop(key_id, None)

    def _live(self, record: StoredResponse, key_id: str) -> bool:
        if record.deleted or record.key_id != key_id:
            return False
        ttl = self.limits.ttl_s
        return not ttl or record.created_at + ttl > self._clock()

    def _key(self, record: StoredResponse) -> str:
        return record.response_id

    def _row(self, record: StoredResponse) -> tuple[object, ...]:
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


def _stored(row: Sequence[Any]) -> StoredResponse:
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
