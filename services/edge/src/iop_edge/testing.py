"""Helpers for the edge's own tests (as ``iop_proto.testing`` is for every service's).

Shipped in the package, not copied into each test module: the wiring below is
bootstrap's, and tests that drive the pool directly must not drift from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from iop_edge.domain.affinity import AffinityPolicy
from iop_edge.domain.events import RunEvent, RunOrder
from iop_edge.domain.outliers import OutlierPolicy
from iop_edge.domain.warmth import WarmPolicy
from iop_edge.errors import StorageQuotaExceeded
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunEvents, StoredResponse
from iop_edge.service.backfill import Backfill
from iop_edge.service.dispatch import Dispatcher
from iop_edge.service.fleet_holder import FleetHolder
from iop_edge.service.registry import ProviderRegistry
from iop_edge.service.runs import UNGUARDED, RunGuards
from iop_edge.settings import EdgeSettings
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE


async def read_all(run: RunEvents) -> list[RunEvent]:
    """Every event ``run`` gives its reader, its end last."""
    events: list[RunEvent] = []
    while batch := await run.next_events():
        events.extend(batch)
    return events


async def one_at_a_time(events: AsyncIterator[RunEvent]) -> tuple[RunEvent, ...]:
    """A fake run's ``next_events`` over its events as an async iterator: the next one
    alone (as if each came in a frame of its own), none once they ran out."""
    async for event in events:
        return (event,)
    return ()


class WiredDispatcher(Dispatcher):
    """The dispatcher with the fleet holder and the pool it draws from, wired as
    ``bootstrap.build`` wires them; ``pool`` is driven as the node listener would.
    Knobs not given keep the defaults of the edge's settings."""

    def __init__(
        self,
        metrics: EdgeMetrics,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        outliers: OutlierPolicy | None = None,
        guards: RunGuards = UNGUARDED,
        affinity: AffinityPolicy | None = None,
        backfill: Backfill | None = None,
        warm: WarmPolicy | None = None,
    ) -> None:
        self.fleet = FleetHolder()
        self.pool = ProviderRegistry(self.fleet, metrics, outliers or OutlierPolicy())
        grace_s = float(EdgeSettings.model_fields["deadline_grace_s"].default)
        super().__init__(
            self.fleet,
            self.pool,
            metrics,
            max_frame_size,
            deadline_grace_s=grace_s,
            guards=guards,
            affinity=affinity,
            backfill=backfill,
            warm=warm,
        )


class RecordingNodeLink:
    """A ``NodeLink`` that keeps the runs sent to it and does nothing else: the tests end
    the runs themselves (``RequestRun.deliver``)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.sent: list[RunOrder] = []

    async def send_run(self, request: RunOrder) -> None:
        self.sent.append(request)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        """Nothing to do: the tests end runs themselves."""


class MemoryResponseStore:
    """A ``ResponseStore`` in a dict: the port's rules (a key's own, deletions, the chain
    of ``previous_id`` links), nothing of SQLite's."""

    def __init__(self, max_depth: int = 1000, quota_bytes: int = 0) -> None:
        self.rows: dict[str, StoredResponse] = {}
        self.max_depth = max_depth
        self.quota_bytes = quota_bytes

    def admit(self, key_id: str, incoming: int) -> None:
        used = sum(r.size for r in self.rows.values() if r.key_id == key_id)
        if self.quota_bytes and used + incoming > self.quota_bytes:
            raise StorageQuotaExceeded("over quota", param="store")

    async def keep(self, response: StoredResponse) -> None:
        self.rows[response.response_id] = response

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        row = self.rows.get(response_id)
        if row is None or row.deleted or row.key_id != key_id:
            return None
        return row

    async def chain(self, response_id: str, key_id: str) -> list[StoredResponse] | None:
        if await self.get(response_id, key_id) is None:
            return None
        links = [self.rows[response_id]]
        while links[-1].previous_id is not None:
            links.append(self.rows[links[-1].previous_id])
        return links[::-1]

    async def delete(self, response_id: str, key_id: str) -> bool:
        row = await self.get(response_id, key_id)
        if row is not None:
            self.rows[response_id] = dataclasses.replace(row, deleted_at=1)
        return row is not None


# Request bodies the edge must refuse with a 400 (malformed, or not JSON at all), by what is
# wrong with each, with the Content-Type each is sent as: the fault suite's hostile input and
# the log-secrets test's.
BAD_BODIES: dict[str, tuple[str, bytes]] = {
    "truncated JSON": ("application/json", b'{"model": "mock-small", "messages": ['),
    "not JSON at all": ("application/json", b"hello"),
    "a JSON array": ("application/json", b'[{"model": "mock-small"}]'),
    "a JSON string": ("application/json", b'"mock-small"'),
    "empty body": ("application/json", b""),
    "NaN": ("application/json", b'{"model": "mock-small", "temperature": NaN}'),
    "invalid UTF-8": ("application/json", b'{"model": "\xff\xfe"}'),
    "nested 100k deep": ("application/json", b"[" * 100_000 + b"]" * 100_000),
    "form-encoded": ("application/x-www-form-urlencoded", b"model=mock-small&messages=hi"),
    "plain text": ("text/plain", b"please answer"),
    "multipart form": (
        "multipart/form-data; boundary=x",
        b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nmock-small\r\n--x--\r\n',
    ),
    "XML": ("application/xml", b"<model>mock-small</model>"),
}
