"""A registered worker's connection: lease requests, renewals, line runs, releases.

Lines run concurrently (the worker bounds how many); the receive loop never
waits for a provider. When the worker's connection drops, its lines in flight
are cancelled and the leases granted on it are freed (``NodeServer``), so a
worker (this one, dialling back, or another) resumes from the first unfinished
line. A worker acts only on leases granted on this connection: ``PeerGuard``
checks every lease operation before it is answered. The shared store down
(``StorageUnavailable``, on PostgreSQL) is expected: the request is answered
with an error the worker retries after, and the connection stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Set
from typing import Final

from loguru import logger

from iop_edge.adapters.peer_guard import PeerGuard
from iop_edge.adapters.run_wire import lease_grant, line_result
from iop_edge.domain.leases import LeaseGrant, LineReply
from iop_edge.errors import EdgeError
from iop_edge.ports import BatchLeases
from iop_proto.connection import Connection, error_body
from iop_proto.errors import ConnectionClosed, UnexpectedMessage
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.service.logging import log_unexpected
from iop_proto.v1 import runtime_pb2 as pb

_STORE_DOWN: Final = "the edge's store is unavailable now; retry shortly"


class WorkerSession:
    def __init__(
        self, worker_id: str, conn: Connection, batches: BatchLeases, guard: PeerGuard
    ) -> None:
        self.worker_id = worker_id
        self.conn = conn
        self._batches = batches
        self._guard = guard
        self._lines: set[asyncio.Task[None]] = set()
        # The leases granted on this connection: its own, and no other connection's,
        # even one of the same worker (``PeerGuard.lease``).
        self._leases: set[str] = set()

    @property
    def leases(self) -> Set[str]:
        return self._leases

    async def serve(self) -> None:
        try:
            async for envelope in self.conn:
                try:
                    await self._answer(envelope)
                except StoreDown as exc:  # from the guard's check, or a release
                    await self._unavailable(envelope, exc)
        finally:
            for task in list(self._lines):
                task.cancel()
            await asyncio.gather(*self._lines, return_exceptions=True)

    async def _answer(self, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        reply_to = envelope.message_id
        guard = self._guard
        if kind == "lease_request":
            guard.lease_request(self, envelope.lease_request)
            await self._reply(self._batches.lease(self.worker_id), reply_to)
        elif kind == "lease_renew":
            lease_id = envelope.lease_renew.lease_id
            await guard.lease(self, lease_id, "renew")
            await self._reply(self._batches.renew(lease_id), reply_to)
        elif kind == "lease_release":
            release = envelope.lease_release
            await guard.lease(self, release.lease_id, "release")
            await self._batches.release(release.lease_id, release.finished)
            self._leases.discard(release.lease_id)
        elif kind == "batch_line_request":
            line = envelope.batch_line_request
            await guard.lease(self, line.lease_id, f"run line {line.line_number} under")
            task = asyncio.create_task(
                self._reply(self._batches.run_line(line.lease_id, line.line_number), reply_to),
                name=f"batch-line:{line.lease_id}:{line.line_number}",
            )
            self._lines.add(task)
            task.add_done_callback(self._lines.discard)
        elif kind == "error":
            logger.warning("worker {} reported: {}", self.worker_id, envelope.error.message)
        else:
            raise UnexpectedMessage(f"an edge does not accept {kind} from a worker")

    async def _reply(self, answer: Awaitable[object], reply_to: str) -> None:
        """Send the awaited answer, or the error it raised, correlated to the request."""
        body: object
        try:
            body = await answer
            if isinstance(body, LeaseGrant):
                if body.lease_id:  # before the worker can learn it: its next use is ours
                    self._leases.add(body.lease_id)
                body = lease_grant(body)
            elif isinstance(body, LineReply):
                body = line_result(body)
        except EdgeError as exc:
            code = pb.ERROR_CODE_NOT_FOUND if exc.status == 404 else pb.ERROR_CODE_PERMISSION_DENIED
            body = error_body(code, exc.message)
        except StoreDown as exc:
            logger.warning("worker {}: a request not answered: {}", self.worker_id, exc)
            body = error_body(pb.ERROR_CODE_INTERNAL, _STORE_DOWN)
        except Exception as exc:
            # Per-request boundary: the worker gets an answer (it would wait for one), and
            # the session goes on serving its other requests.
            log_unexpected(exc, "worker {}: a request failed in the edge", self.worker_id)
            body = error_body(pb.ERROR_CODE_INTERNAL, "the edge failed to answer")
        with contextlib.suppress(ConnectionClosed):
            await self.conn.send(body, correlation_id=reply_to)

    async def _unavailable(self, envelope: pb.Envelope, exc: StoreDown) -> None:
        """The store failed before a request was answered: an error to the request that
        waits for an answer (a release waits for none: its lease expires instead)."""
        kind = envelope.WhichOneof("body")
        logger.warning("worker {}: {} not answered: {}", self.worker_id, kind, exc)
        if kind != "lease_release":
            with contextlib.suppress(ConnectionClosed):
                await self.conn.send(
                    error_body(pb.ERROR_CODE_INTERNAL, _STORE_DOWN),
                    correlation_id=envelope.message_id,
                )
