"""The OpenAI Batch API at the edge: files, batches, and the leases workers run them under.

Clients upload a JSONL file and create a batch; workers lease a batch, ask the
edge to run its lines one by one (``run_line``: through normal dispatch, at
batch priority) and release it; the edge stores each line's result as it
finishes and writes the output and error files at the end.

This module is the clients' side, and the one object bootstrap wires (into the
HTTP API and the worker listener); the workers' side lives in ``batch_work``,
the line runs in ``batch_lines``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Final

from loguru import logger
from prometheus_client import CollectorRegistry

from iop_edge.batch_ports import BatchStore
from iop_edge.domain import drills
from iop_edge.domain.batches import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    LINE_FAILED,
    BatchRecord,
    FileRecord,
    InputCheck,
    LineResult,
    batch_object,
    check_input,
    file_object,
    input_lines,
    may_see,
    new_batch,
    new_id,
    owner_of,
    scope_of,
)
from iop_edge.domain.drills import may_drill
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.domain.leases import LeaseGrant, LineReply
from iop_edge.errors import InvalidRequest, ModelNotAllowed, NotFound, RequestTooLarge
from iop_edge.formats.errors import error_payload
from iop_edge.formats.openai import dumps
from iop_edge.metrics import BatchMetrics
from iop_edge.ports import Catalog, RunService
from iop_edge.service.batch_file_io import FileContent, Upload, physical_lines, quota_exceeded
from iop_edge.service.batch_lines import Account, LineRunner
from iop_edge.service.batch_work import BatchWork
from iop_edge.service.key_rates import LineBudget
from iop_edge.service.limits import DEFAULT_MAX_BODY_BYTES

MAX_FILE_BYTES: Final = 200 * 1024 * 1024
"""OpenAI's limit for a batch input file. Uploads are streamed to disk, so memory is
not the reason; a batch's lines are copied into the store, and the disk is finite."""
RETRY_DELAY_S: Final = 5.0
"""A batch released as finished with lines still pending (the fleet had no room
for them) rests this long before it can be leased again."""
MAX_METADATA_KEYS: Final = 16


class BatchService:
    """Files and batches for the HTTP API; leases and line runs for workers (``BatchLeases``)."""

    def __init__(
        self,
        store: BatchStore,
        runs: RunService,
        catalog: Catalog,
        metrics_registry: CollectorRegistry,
        *,
        lease_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        max_file_bytes: int = MAX_FILE_BYTES,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retry_delay_s: float = RETRY_DELAY_S,
        mock_drills: bool = False,
        file_quota_bytes: int = 0,
        line_budget: LineBudget | None = None,
        account: Account | None = None,
    ) -> None:
        """``max_body_bytes``: a line's body over it fails alone (413), as it would over HTTP.
        ``mock_drills``: lines of every key may ask the mock for a failure drill, not only
        an operator key's (domain/drills.py); another key's such line fails alone (400).
        ``file_quota_bytes``: the most a key's files may take together (0: no quota);
        an upload that would pass it is refused as it arrives.
        ``line_budget``: lines count against their owner's token budget.
        ``account``: where each line's run is recorded (the run log and the metrics)."""
        self.max_file_bytes = max_file_bytes
        self.file_quota_bytes = file_quota_bytes
        self._max_body_bytes = max_body_bytes
        self._mock_drills = mock_drills
        self._store = store
        self._metrics = BatchMetrics.create(metrics_registry)
        self._clock = clock
        self._work = BatchWork(
            store,
            LineRunner(runs, catalog, clock, line_budget, account),
            self._metrics,
            lease_ttl_s=lease_ttl_s,
            clock=clock,
            retry_delay_s=retry_delay_s,
        )

    def _now(self) -> int:
        return int(self._clock())

    # ------------------------------------------------------------------ files
    #
    # Ownership: what a key creates is that key's (its ``key_id`` is stored); any other
    # key is told it does not exist (404, like an id never issued); an operator key
    # and the open API (``key`` None) see everything.

    @contextlib.asynccontextmanager
    async def receive_file(self, *, key: ApiKeyEntry | None = None) -> AsyncIterator[Upload]:
        """A new upload, written to storage as it arrives; ``create_file`` stores it, and
        whatever was not stored is dropped when the block ends (an error, a disconnect).
        Refused (``StorageQuotaExceeded``) once it would take ``key`` over its quota."""
        room = None
        if self.file_quota_bytes:
            used = await self._store.owned_bytes(owner_of(key))
            room = self.file_quota_bytes - used
            if room <= 0:
                raise quota_exceeded(used, self.file_quota_bytes)
        file_id = new_id("file-")
        sink = await self._store.begin_upload(file_id)
        upload = Upload(file_id, sink, self.max_file_bytes, room, self.file_quota_bytes)
        try:
            yield upload
        finally:
            await upload.discard()

    async def create_file(
        self, upload: Upload, filename: str, purpose: str, *, key: ApiKeyEntry | None = None
    ) -> dict[str, Any]:
        """Store a received upload as ``key``'s file."""
        if purpose != "batch":
            raise InvalidRequest(
                f"Invalid purpose '{purpose}': this server accepts only 'batch'.", param="purpose"
            )
        name = filename or "upload.jsonl"
        record = FileRecord(upload.file_id, name, purpose, upload.size, self._now(), owner_of(key))
        await upload.commit(record)
        return file_object(record)

    async def get_file(self, file_id: str, *, key: ApiKeyEntry | None = None) -> dict[str, Any]:
        return file_object(await self._file(file_id, key))

    async def list_files(
        self,
        purpose: str | None,
        after: str | None,
        limit: int,
        *,
        newest: bool = True,
        key: ApiKeyEntry | None = None,
    ) -> dict[str, Any]:
        """The caller's files (an operator's or the open API's: all), like OpenAI's list."""
        records = await self._store.list_files(scope_of(key), purpose, after, limit + 1, newest)
        return _page([file_object(record) for record in records], limit)

    async def file_content(self, file_id: str, *, key: ApiKeyEntry | None = None) -> FileContent:
        """The file open for reading in chunks; the caller reads or closes it."""
        record = await self._file(file_id, key)
        handle = await self._store.open_content(file_id)
        if handle is None:
            raise _no_file(file_id)
        return FileContent(record, handle)

    async def delete_file(self, file_id: str, *, key: ApiKeyEntry | None = None) -> dict[str, Any]:
        """A batch keeps running when its input file is deleted: its lines are stored apart."""
        await self._file(file_id, key)
        if not await self._store.delete_file(file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def _file(self, file_id: str, key: ApiKeyEntry | None, param: str = "id") -> FileRecord:
        record = await self._store.get_file(file_id)
        if record is None or not may_see(key, record.owner):
            raise NotFound(f"No such File object: {file_id}", param=param)
        return record

    # ------------------------------------------------------------------ batches

    async def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        *,
        key: ApiKeyEntry | None = None,
    ) -> dict[str, Any]:
        """Validate the whole input file now; an invalid one makes a ``failed`` batch.

        ``key``: the caller's API key policy; the batch, and its output and error
        files, are its key's. The input file must be one the key may see. A line
        naming a model the key may not use fails alone (403 ``model_not_allowed``
        in the error file) and never runs: the key's allow-list is not known when
        a worker runs it. So does a line whose body is over the body limit (413
        ``request_too_large``): it could never be carried to a node, and the rest
        of the batch goes on.

        The file is read twice, a line at a time, off the event loop: once to
        check it (holding the custom ids and the first errors), once to store its
        lines. Neither reading holds the file, only the line in hand.
        """
        if endpoint not in ENDPOINTS:
            allowed = ", ".join(ENDPOINTS)
            raise InvalidRequest(f"'endpoint' must be one of {allowed}.", param="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequest("'completion_window' must be '24h'.", param="completion_window")
        _check_metadata(metadata)
        file = await self._file(input_file_id, key, param="input_file_id")
        if file.purpose != "batch":
            raise InvalidRequest(
                f"The file {input_file_id} has purpose '{file.purpose}'; a batch needs 'batch'.",
                param="input_file_id",
            )
        content = await self._store.open_content(input_file_id)
        if content is None:
            raise NotFound(f"No such File object: {input_file_id}", param="input_file_id")
        try:
            check = await asyncio.to_thread(
                check_input, physical_lines(content), endpoint, self._max_body_bytes
            )
            batch = new_batch(
                new_id("batch_"),
                input_file_id,
                endpoint,
                completion_window,
                metadata,
                check,
                self._now(),
                owner_of(key),
            )
            # The second reading runs on the store's thread, inside its transaction.
            lines = () if check.errors else input_lines(physical_lines(content), endpoint)
            refused = _refused(check, key, self._max_body_bytes, may_drill(key, self._mock_drills))
            await self._store.insert_batch(batch, lines, refused)
        finally:
            await asyncio.to_thread(content.close)
        self._metrics.lines.labels("failed").inc(len(refused))
        await self._work.refresh_metrics()
        return await self.get_batch(batch.id, key=key)

    async def get_batch(self, batch_id: str, *, key: ApiKeyEntry | None = None) -> dict[str, Any]:
        return batch_object(await self._batch(batch_id, key))

    async def list_batches(
        self, after: str | None, limit: int, *, key: ApiKeyEntry | None = None
    ) -> dict[str, Any]:
        """The caller's batches, newest first (an operator's or the open API's: all)."""
        records = await self._store.list_batches(after, limit + 1, scope_of(key))
        return _page([batch_object(record) for record in records], limit)

    async def cancel_batch(
        self, batch_id: str, *, key: ApiKeyEntry | None = None
    ) -> dict[str, Any]:
        """``cancelling`` while a worker holds the batch, ``cancelled`` at once otherwise;
        a batch that already ended (or is ending) is returned as is, like OpenAI does."""
        await self._batch(batch_id, key)
        await self._work.cancel(batch_id)
        return await self.get_batch(batch_id, key=key)

    async def apply_keys(self, present: frozenset[str]) -> int:
        """The fleet's keys are now ``present``: cancel every batch of a key that is not.

        A revoked key's batches must stop, not run on through the workers: each one not
        ended is cancelled at once (the cancel path, without waiting for its worker),
        its lines in flight stopped and left unfinished, its output and error files
        written for what finished. Decided from the store, not from what changed, so a
        key revoked while the edge was down has its batches cancelled when the edge's
        first fleet config arrives. Batches of the open API (no owner) are never
        touched. Returns how many were cancelled (logged once per key, with its count).

        A store failure is logged, not raised: the fleet update it is part of must go
        on, and the next one tries again.
        """
        try:
            owners = {
                batch_id: owner
                for batch_id, owner in await self._store.owned_unended()
                if owner not in present
            }
            ended = await self._work.cancel_at_once(owners) if owners else []
        except Exception:
            logger.exception("cancelling the batches of revoked API keys failed; will retry")
            return 0
        cancelled = Counter(owners[batch_id] for batch_id in ended)
        for owner, count in cancelled.items():
            logger.warning("API key {} revoked: cancelled its {} batch(es)", owner, count)
        return sum(cancelled.values())

    async def refresh_metrics(self) -> None:
        """Publish the batches-by-status gauge (it follows every change; call once at start)."""
        await self._work.refresh_metrics()

    async def _batch(self, batch_id: str, key: ApiKeyEntry | None) -> BatchRecord:
        batch = await self._store.get_batch(batch_id)
        if batch is None or not may_see(key, batch.owner):
            raise NotFound(f"No such Batch object: {batch_id}", param="id")
        return batch

    # ------------------------------------------------------------------ workers

    # ------------------------------------------------------------------ workers (BatchLeases)

    async def worker_registered(self, worker_id: str) -> None:
        await self._work.worker_registered(worker_id)

    async def connection_ended(self, worker_id: str, lease_ids: Iterable[str]) -> None:
        await self._work.connection_ended(worker_id, lease_ids)

    async def lease(self, worker_id: str) -> LeaseGrant:
        """The oldest batch with work and no live lease; an empty grant when there is none."""
        return await self._work.lease(worker_id)

    async def renew(self, lease_id: str) -> LeaseGrant:
        """Extend a lease; raises ``LeaseLost`` when the worker must stop."""
        return await self._work.renew(lease_id)

    async def release(self, lease_id: str, finished: bool) -> None:
        await self._work.release(lease_id, finished)

    async def run_line(self, lease_id: str, line_number: int) -> LineReply:
        """Run one line (0-based), or answer it from storage when it finished already."""
        return await self._work.run_line(lease_id, line_number)

    async def lease_holder(self, lease_id: str) -> str | None:
        return await self._work.lease_holder(lease_id)


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="id")


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page of ``data`` (fetched with one more than ``limit``)."""
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def _refused(
    check: InputCheck, key: ApiKeyEntry | None, max_body_bytes: int, drills_allowed: bool
) -> dict[int, LineResult]:
    """The lines failed in advance: a model ``key`` may not use, a body over the limit, a
    mock drill ``key`` may not ask for."""
    if check.errors:
        return {}
    refused = {} if drills_allowed else {index: _drill_refused() for index in check.drills}
    refused.update((index, _too_large(max_body_bytes)) for index in check.oversize)
    if key is not None:
        for model, indices in check.models.items():
            if not key.allows(model):
                refused.update((index, _refusal(model)) for index in indices)
    return refused


def _refusal(model: str) -> LineResult:
    error = ModelNotAllowed(
        f"This API key is not allowed to use the model '{model}'.", param="model"
    )
    body = dumps(error_payload(error))
    return LineResult(LINE_FAILED, error.status, None, body, "", new_id("batch_req_"))


def _drill_refused() -> LineResult:
    error = InvalidRequest(drills.REFUSAL, param=drills.HOOK)
    body = dumps(error_payload(error))
    return LineResult(LINE_FAILED, error.status, None, body, "", new_id("batch_req_"))


def _too_large(limit: int) -> LineResult:
    error = RequestTooLarge(f"The request body is larger than the limit of {limit} bytes.")
    body = dumps(error_payload(error))
    return LineResult(LINE_FAILED, error.status, None, body, "", new_id("batch_req_"))


def _check_metadata(metadata: object) -> None:
    """OpenAI's rule: up to 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_KEYS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise InvalidRequest(
            "'metadata' must be an object of at most 16 string pairs "
            "(keys up to 64 characters, values up to 512).",
            param="metadata",
        )
