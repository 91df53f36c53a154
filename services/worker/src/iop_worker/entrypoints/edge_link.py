"""The worker's link to the edge: dial, register, serve the batch runner, reconnect.

The worker dials the edge's node listener (never the reverse) with its own
certificate, whose role ``worker`` is its credential. Over one registered
connection requests and answers are matched by correlation id: the answer to
a request carries the request's ``message_id``. One reader task resolves the
waiting requests; when the connection goes, every waiting request fails at
once, the batch in hand is abandoned without a release (its lease expires at
the edge), and the link reconnects after a jittered, growing delay (the dial,
register and reconnect loop is ``iop_proto.dialer.Dialer``, the node's too).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Sequence

from loguru import logger

from iop_proto.connection import Connection
from iop_proto.dialer import Dialer, DialSettings, LinkGauge, code_name
from iop_proto.errors import ConnectionClosed, UnexpectedMessage
from iop_proto.v1 import runtime_pb2 as pb
from iop_worker.batch_runner import BatchRunner
from iop_worker.domain.batches import Lease, LineResult
from iop_worker.errors import EdgeLinkLost, EdgeRefused, LeaseLost
from iop_worker.settings import WorkerSettings

# Error codes with which the edge says a lease is gone (cancelled, expired, taken over).
_LEASE_GONE = frozenset({pb.ERROR_CODE_NOT_FOUND, pb.ERROR_CODE_PERMISSION_DENIED})
# Answers that may arrive after their request gave up waiting: dropped, not a fault.
_ANSWERS = frozenset({"lease_grant", "batch_line_result", "register_response"})
_OPTIONAL_ANSWERS_KEPT = 64


class EdgeSession:
    """The ``EdgePort`` over one registered connection, with its request/answer plumbing."""

    def __init__(
        self,
        conn: Connection,
        *,
        worker_id: str,
        answer_timeout_s: float,
        line_timeout_s: float,
        edges_heard: Callable[[Sequence[pb.EdgeEndpoint]], None] | None = None,
    ) -> None:
        self._conn = conn
        self._edges_heard = edges_heard
        self._worker_id = worker_id
        self._answer_timeout_s = answer_timeout_s
        self._line_timeout_s = line_timeout_s
        # message id of a request -> (its waiting future, the body kind that answers it)
        self._pending: dict[str, tuple[asyncio.Future[pb.Envelope], str]] = {}
        # requests whose answer is optional (release): an ack is logged, never awaited
        self._optional: deque[str] = deque(maxlen=_OPTIONAL_ANSWERS_KEPT)
        self._lost: EdgeLinkLost | None = None

    # ------------------------------------------------------------ EdgePort

    async def lease(self) -> Lease | None:
        async with asyncio.timeout(self._answer_timeout_s):
            answer = await self._request(pb.LeaseRequest(worker_id=self._worker_id), "lease_grant")
        grant = answer.lease_grant
        if not grant.batch_id:
            return None
        return Lease(
            batch_id=grant.batch_id,
            lease_id=grant.lease_id,
            endpoint=grant.endpoint,
            next_line=grant.next_line,
            total_lines=grant.total_lines,
            expires_at_unix_ms=grant.expires_at_unix_ms,
        )

    async def renew(self, lease: Lease) -> None:
        body = pb.LeaseRenew(lease_id=lease.lease_id)
        async with asyncio.timeout(self._answer_timeout_s):
            await self._lease_request(body, "lease_grant")

    async def run_line(self, lease: Lease, line_number: int) -> LineResult:
        body = pb.BatchLineRequest(lease_id=lease.lease_id, line_number=line_number)
        async with asyncio.timeout(self._line_timeout_s):
            answer = await self._lease_request(body, "batch_line_result")
        result = answer.batch_line_result
        return LineResult(
            line_number=result.line_number,
            status_code=result.status_code,
            custom_id=result.custom_id,
        )

    async def release(self, lease: Lease, *, finished: bool) -> None:
        envelope = self._conn.envelope(pb.LeaseRelease(lease_id=lease.lease_id, finished=finished))
        self._optional.append(envelope.message_id)
        await self._send(envelope)

    # ------------------------------------------------------------ requests

    async def _lease_request(self, body: object, answer_kind: str) -> pb.Envelope:
        """A request about a lease: the codes that mean "lease gone" become ``LeaseLost``."""
        try:
            return await self._request(body, answer_kind)
        except EdgeRefused as exc:
            if exc.code in _LEASE_GONE:
                raise LeaseLost(exc.code, exc.message) from exc
            raise

    async def _request(self, body: object, answer_kind: str) -> pb.Envelope:
        """Send ``body`` and wait for its correlated answer (the reader resolves it).

        Callers bound the wait with ``asyncio.timeout``; giving up forgets the
        request, so a late answer is dropped by the reader.
        """
        if self._lost is not None:
            raise self._lost
        envelope = self._conn.envelope(body)
        future: asyncio.Future[pb.Envelope] = asyncio.get_running_loop().create_future()
        self._pending[envelope.message_id] = (future, answer_kind)
        try:
            await self._send(envelope)
            return await future
        finally:
            self._pending.pop(envelope.message_id, None)

    async def _send(self, envelope: pb.Envelope) -> None:
        if self._lost is not None:
            raise self._lost
        try:
            await self._conn.send_envelope(envelope)
        except (ConnectionClosed, ConnectionError, OSError) as exc:
            raise EdgeLinkLost(f"cannot send to the edge: {exc}") from exc

    # ------------------------------------------------------------ receiving

    async def read(self) -> None:
        """Resolve answers until the connection ends; then fail every waiting request.

        Returns when the edge closes the connection; raises ``ProtocolError``
        when the edge breaks the protocol (the link closes the connection with it).
        """
        try:
            async for envelope in self._conn:
                self._on_envelope(envelope)
        finally:
            self._fail_pending(EdgeLinkLost(f"the connection to {self._conn.peer_name} ended"))

    def _on_envelope(self, envelope: pb.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        correlation_id = envelope.correlation_id
        pending = self._pending.get(correlation_id) if correlation_id else None
        if pending is not None:
            future, expected = pending
            if kind != "error" and kind != expected:
                raise UnexpectedMessage(f"{kind} answers {correlation_id}, expected {expected}")
            if not future.done():
                if kind == "error":
                    future.set_exception(EdgeRefused(envelope.error.code, envelope.error.message))
                else:
                    future.set_result(envelope)
            return
        if correlation_id and correlation_id in self._optional:
            self._optional.remove(correlation_id)
            if kind == "error":
                logger.warning("the edge refused a lease release: {}", envelope.error.message)
            return
        if kind == "error":
            error = envelope.error
            logger.warning("the edge reported {}: {}", code_name(error.code), error.message)
        elif kind == "register_response" and not correlation_id:
            # a push: the edges the control-plane lists now
            if self._edges_heard is not None:
                self._edges_heard(envelope.register_response.edges)
        elif kind in _ANSWERS:
            logger.debug("dropped a late {} (its request gave up waiting)", kind)
        else:
            raise UnexpectedMessage(f"a worker does not accept {kind} from the edge")

    def _fail_pending(self, error: EdgeLinkLost) -> None:
        self._lost = error
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)


class EdgeLink(Dialer):
    """Keeps the worker registered with one edge, and the batch runner fed from it, until
    stopped (``EdgeLinks`` keeps one for each edge: one lease loop per edge)."""

    def __init__(
        self,
        dial: DialSettings,
        settings: WorkerSettings,
        runner: BatchRunner,
        tls: ssl.SSLContext | None,
        gauge: LinkGauge,
        version: str,
    ) -> None:
        super().__init__(dial, tls, gauge)
        self._settings = settings
        self._runner = runner
        self._version = version

    def _register_request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(
            peer_id=self._settings.service_id,
            role=pb.PEER_ROLE_WORKER,
            version=self._version,
            follows_edges=self._settings.follow_edges,
        )

    async def _serve(self, conn: Connection) -> None:
        """Run the reader and the batch runner until either ends; the other is cancelled.

        Returns when the runner stopped on request; raises ``EdgeLinkLost`` when
        the connection ended, or whatever the task that ended first raised.
        """
        session = EdgeSession(
            conn,
            worker_id=self._settings.service_id,
            answer_timeout_s=self._settings.answer_timeout_s,
            line_timeout_s=self._settings.request_timeout_s,
            edges_heard=self._heard_edges,
        )
        reader = asyncio.create_task(session.read(), name="edge-reader")
        runner = asyncio.create_task(self._runner.run(session), name="batch-runner")
        tasks = (reader, runner)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # A protocol fault explains the end best; then a runner failure; else a plain close.
        if not reader.cancelled() and (fault := reader.exception()) is not None:
            raise fault
        if runner.cancelled():
            raise EdgeLinkLost(f"the edge {conn.peer_name} closed the connection")
        if (failure := runner.exception()) is not None:
            raise failure
