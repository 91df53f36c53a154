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
import time
from collections.abc import Callable
from typing import Any, Final

from prometheus_client import CollectorRegistry

from iop_edge.batch_lines import LineRunner
from iop_edge.batch_ports import BatchStore
from iop_edge.batch_work import BatchWork
from iop_edge.domain.batches import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    LINE_FAILED,
    BatchRecord,
    FileRecord,
    LineResult,
    batch_object,
    file_object,
    new_batch,
    new_id,
    parse_input,
)
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.openai_errors import error_payload
from iop_edge.entrypoints.openai_format import dumps
from iop_edge.errors import InvalidRequest, ModelNotAllowed, NotFound, RequestTooLarge
from iop_edge.limits import DEFAULT_MAX_BODY_BYTES
from iop_edge.metrics import BatchMetrics
from iop_edge.ports import Catalog, RunService
from iop_proto.v1 import runtime_pb2 as pb

MAX_FILE_BYTES: Final = 200 * 1024 * 1024
"""OpenAI's limit for a batch input file; files live in SQLite BLOBs and in memory
while uploaded or validated, which is why there is a limit at all."""
RETRY_DELAY_S: Final = 5.0
"""A batch released as finished with lines still pending (the fleet had no room
for them) rests this long before it can be leased again."""
PARSE_OFFLOAD_BYTES: Final = 256 * 1024
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
    ) -> None:
        """``max_body_bytes``: a line's body over it fails alone (413), as it would over HTTP."""
        self.max_file_bytes = max_file_bytes
        self._max_body_bytes = max_body_bytes
        self._store = store
        self._metrics = BatchMetrics.create(metrics_registry)
        self._clock = clock
        self._work = BatchWork(
            store,
            LineRunner(runs, catalog, clock),
            self._metrics,
            lease_ttl_s=lease_ttl_s,
            clock=clock,
            retry_delay_s=retry_delay_s,
        )

    def _now(self) -> int:
        return int(self._clock())

    # ------------------------------------------------------------------ files

    async def create_file(self, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        if purpose != "batch":
            raise InvalidRequest(
                f"Invalid purpose '{purpose}': this server accepts only 'batch'.", param="purpose"
            )
        if len(content) > self.max_file_bytes:
            raise InvalidRequest(
                f"The file is larger than the limit of {self.max_file_bytes} bytes.", param="file"
            )
        name = filename or "upload.jsonl"
        record = FileRecord(new_id("file-"), name, purpose, len(content), self._now())
        await self._store.insert_file(record, content)
        return file_object(record)

    async def get_file(self, file_id: str) -> dict[str, Any]:
        record = await self._store.get_file(file_id)
        if record is None:
            raise _no_file(file_id)
        return file_object(record)

    async def file_content(self, file_id: str) -> bytes:
        content = await self._store.file_content(file_id)
        if content is None:
            raise _no_file(file_id)
        return content

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        """A batch keeps running when its input file is deleted: its lines are stored apart."""
        if not await self._store.delete_file(file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

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

        ``key``: the caller's API key policy. A line naming a model the key may
        not use fails alone (403 ``model_not_allowed`` in the error file) and
        never runs: the key's allow-list is not known when a worker runs it. So
        does a line whose body is over the body limit (413 ``request_too_large``):
        it could never be carried to a node, and the rest of the batch goes on.
        """
        if endpoint not in ENDPOINTS:
            allowed = ", ".join(ENDPOINTS)
            raise InvalidRequest(f"'endpoint' must be one of {allowed}.", param="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequest("'completion_window' must be '24h'.", param="completion_window")
        _check_metadata(metadata)
        file = await self._store.get_file(input_file_id)
        content = await self._store.file_content(input_file_id)
        if file is None or content is None:
            raise NotFound(f"No such File object: {input_file_id}", param="input_file_id")
        if file.purpose != "batch":
            raise InvalidRequest(
                f"The file {input_file_id} has purpose '{file.purpose}'; a batch needs 'batch'.",
                param="input_file_id",
            )
        if len(content) > PARSE_OFFLOAD_BYTES:
            parsed = await asyncio.to_thread(parse_input, content, endpoint)
        else:
            parsed = parse_input(content, endpoint)
        now = self._now()
        batch = new_batch(
            new_id("batch_"), input_file_id, endpoint, completion_window, metadata, parsed, now
        )
        lines = [] if parsed.errors else parsed.lines
        refused = {
            line.index: _refusal(line.model)
            for line in lines
            if key is not None and line.model is not None and not key.allows(line.model)
        }
        for line in lines:
            if line.index not in refused and _utf8_size(line.body_json) > self._max_body_bytes:
                refused[line.index] = _too_large(self._max_body_bytes)
        await self._store.insert_batch(batch, lines, refused)
        self._metrics.lines.labels("failed").inc(len(refused))
        await self._work.refresh_metrics()
        return await self.get_batch(batch.id)

    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        return batch_object(await self._batch(batch_id))

    async def list_batches(self, after: str | None, limit: int) -> dict[str, Any]:
        records = await self._store.list_batches(after, limit + 1)
        data = [batch_object(record) for record in records[:limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(records) > limit,
        }

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """``cancelling`` while a worker holds the batch, ``cancelled`` at once otherwise;
        a batch that already ended (or is ending) is returned as is, like OpenAI does."""
        await self._batch(batch_id)
        await self._work.cancel(batch_id)
        return await self.get_batch(batch_id)

    async def refresh_metrics(self) -> None:
        """Publish the batches-by-status gauge (it follows every change; call once at start)."""
        await self._work.refresh_metrics()

    async def _batch(self, batch_id: str) -> BatchRecord:
        batch = await self._store.get_batch(batch_id)
        if batch is None:
            raise NotFound(f"No such Batch object: {batch_id}", param="id")
        return batch

    # ------------------------------------------------------------------ workers

    # ------------------------------------------------------------------ workers (BatchLeases)

    async def worker_registered(self, worker_id: str) -> None:
        await self._work.worker_registered(worker_id)

    async def lease(self, worker_id: str) -> pb.LeaseGrant:
        """The oldest batch with work and no live lease; an empty grant when there is none."""
        return await self._work.lease(worker_id)

    async def renew(self, lease_id: str) -> pb.LeaseGrant:
        """Extend a lease; raises ``LeaseLost`` when the worker must stop."""
        return await self._work.renew(lease_id)

    async def release(self, lease_id: str, finished: bool) -> None:
        await self._work.release(lease_id, finished)

    async def run_line(self, lease_id: str, line_number: int) -> pb.BatchLineResult:
        """Run one line (0-based), or answer it from storage when it finished already."""
        return await self._work.run_line(lease_id, line_number)


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="id")


def _refusal(model: str) -> LineResult:
    error = ModelNotAllowed(
        f"This API key is not allowed to use the model '{model}'.", param="model"
    )
    body = dumps(error_payload(error))
    return LineResult(LINE_FAILED, error.status, None, body, "", new_id("batch_req_"))


def _utf8_size(text: str) -> int:
    # surrogatepass: a lone surrogate (a JSON escape cut in half) still has a size
    return len(text.encode("utf-8", "surrogatepass"))


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
