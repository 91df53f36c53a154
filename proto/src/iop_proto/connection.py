"""A framed connection to one peer: send and receive envelopes, supervise liveness.

The owner reads with ``receive()`` (or ``async for``) continuously; any frame
counts as a sign of life, heartbeats are answered by nothing and never reach the
owner. A protocol fault sends an ``error`` frame, closes this one connection and
raises the typed error: it never takes the process down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from types import TracebackType

from loguru import logger

from iop_proto.errors import ConnectionClosed, HeartbeatTimeout, ProtocolError
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE, encode_frame, read_frame
from iop_proto.tls import PeerIdentity, peer_identity
from iop_proto.v1 import runtime_pb2 as pb

DEFAULT_HEARTBEAT_INTERVAL = 30.0
DEFAULT_MISSED_HEARTBEATS = 3
_CLOSE_TIMEOUT = 2.0


def error_body(code: int, message: str, run_id: str = "") -> pb.Error:
    """Build an ``error`` body (a tiny helper so callers never misspell fields)."""
    return pb.Error(code=code, message=message, run_id=run_id)  # type: ignore[arg-type]


class Connection:
    """One peer link: envelopes in and out, heartbeats, and a single way to close."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        sender_id: str,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        missed_heartbeats: int = DEFAULT_MISSED_HEARTBEATS,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._sender_id = sender_id
        self._ids = itertools.count(1)
        self.max_frame_size = max_frame_size
        self.heartbeat_interval = heartbeat_interval
        self.missed_heartbeats = missed_heartbeats
        self.peer: PeerIdentity | None = peer_identity(writer)
        self.peer_error: pb.Error | None = None  # the last error frame the peer sent
        self._last_received = time.monotonic()
        self._closed = asyncio.Event()
        self._fault: ProtocolError | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifetime

    async def __aenter__(self) -> Connection:
        self.start_heartbeats()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def start_heartbeats(self) -> None:
        """Send heartbeats and watch for silence; owned by this connection."""
        if self._heartbeat_task is None and self.heartbeat_interval > 0:
            self._heartbeat_task = asyncio.create_task(
                self._heartbeat_loop(), name=f"heartbeat:{self.peer_name}"
            )

    @property
    def peer_name(self) -> str:
        if self.peer is not None:
            return self.peer.name
        peername = self._writer.get_extra_info("peername")
        return str(peername) if peername else "unknown"

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self, error: pb.Error | None = None) -> None:
        """Close once: send ``error`` first if given, then the transport. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if error is not None and not self._writer.is_closing():
            with contextlib.suppress(ConnectionError, ProtocolError, OSError):
                self._writer.write(encode_frame(self.envelope(error), self.max_frame_size))
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError, TimeoutError, asyncio.TimeoutError):
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self._writer.wait_closed()

    async def abort(self, fault: ProtocolError) -> None:
        """Close because of a protocol fault, telling the peer why."""
        if self._fault is None:
            self._fault = fault
        logger.warning("closing connection to {}: {}", self.peer_name, fault)
        await self.close(error_body(fault.code, str(fault)))

    # ------------------------------------------------------------ sending

    def envelope(self, body: object, correlation_id: str = "") -> pb.Envelope:
        """Wrap a body in a new envelope (its id is known before it is sent)."""
        envelope = pb.Envelope(
            message_id=f"{self._sender_id}-{next(self._ids)}",
            correlation_id=correlation_id,
            sent_at_unix_ms=int(time.time() * 1000),
        )
        field = _BODY_FIELDS.get(type(body))
        if field is None:
            raise TypeError(f"{type(body).__name__} is not an Envelope body")
        getattr(envelope, field).CopyFrom(body)
        return envelope

    async def send(self, body: object, *, correlation_id: str = "") -> pb.Envelope:
        """Wrap a body message in an envelope, send it, and wait for drain."""
        envelope = self.envelope(body, correlation_id)
        await self.send_envelope(envelope)
        return envelope

    async def send_envelope(self, envelope: pb.Envelope) -> None:
        if self._closed.is_set() or self._writer.is_closing():
            raise ConnectionClosed(f"connection to {self.peer_name} is closed") from self._fault
        self._writer.write(encode_frame(envelope, self.max_frame_size))
        await self._writer.drain()

    # ------------------------------------------------------------ receiving

    async def receive(self) -> pb.Envelope:
        """The next non-heartbeat envelope.

        Raises the typed ``ProtocolError`` after closing on a bad frame, and
        ``ConnectionClosed`` once the connection is gone for any other reason.
        """
        while True:
            if self._closed.is_set():
                raise self._closed_error()
            try:
                envelope = await read_frame(self._reader, self.max_frame_size)
            except ProtocolError as fault:
                if self._closed.is_set():  # our own close cut the read short
                    raise self._closed_error() from None
                await self.abort(fault)
                raise
            except (ConnectionClosed, ConnectionError, OSError) as exc:
                await self.close()
                raise self._closed_error() from exc
            self._last_received = time.monotonic()
            kind = envelope.WhichOneof("body")
            if kind == "heartbeat":
                continue
            if kind == "error":
                self.peer_error = envelope.error
            return envelope

    def _closed_error(self) -> ProtocolError | ConnectionClosed:
        if self._fault is not None:
            return self._fault
        return ConnectionClosed(f"connection to {self.peer_name} closed", self.peer_error)

    async def __aiter__(self) -> AsyncIterator[pb.Envelope]:
        """Envelopes until the peer closes cleanly; protocol faults still raise."""
        while True:
            try:
                yield await self.receive()
            except ConnectionClosed:
                return

    # ------------------------------------------------------------ liveness

    async def _heartbeat_loop(self) -> None:
        allowed_silence = self.heartbeat_interval * self.missed_heartbeats
        while not self._closed.is_set():
            await asyncio.sleep(self.heartbeat_interval)
            silence = time.monotonic() - self._last_received
            if silence > allowed_silence:
                await self.abort(
                    HeartbeatTimeout(
                        f"no frame from {self.peer_name} for {silence:.1f}s "
                        f"({self.missed_heartbeats} heartbeats missed)"
                    )
                )
                return
            try:
                await self.send(pb.Heartbeat(monotonic_ms=int(time.monotonic() * 1000)))
            except (ConnectionError, OSError):
                await self.close()
                return


def _body_fields() -> dict[type, str]:
    """Map each body message class to its field in the ``Envelope`` oneof."""
    oneof = pb.Envelope.DESCRIPTOR.oneofs_by_name["body"]
    fields: dict[type, str] = {}
    for field in oneof.fields:
        assert field.message_type is not None  # every body is a message
        fields[getattr(pb, field.message_type.name)] = field.name
    return fields


_BODY_FIELDS = _body_fields()
