"""A framed connection to one peer: send and receive envelopes, supervise liveness.

The owner reads with ``receive()`` (or ``async for``) continuously; any bytes
received count as a sign of life, heartbeats are answered by nothing and never
reach the owner. A peer silent for ``missed_heartbeats`` intervals (2 s each by
default) is dead: it is sent the error frame and the transport is aborted at
once, without TLS's close_notify exchange (a frozen or cut-off peer never
answers it), so the owner's read ends within the same pass and its cleanup (the
edge: the node's providers unavailable, its runs failed) does not wait for a
teardown. The socket also carries TCP keepalive and a user timeout
(``iop_proto.keepalive``), on both ends.

A protocol fault sends an ``error`` frame, closes this one connection and
raises the typed error: it never takes the process down. A frame whose header
arrived must be complete within ``frame_read_timeout``: silence between frames
is for the heartbeats to judge, half a frame held open is a fault.

Frames sent with ``defer=True`` (a stream's tokens, the edge's run requests) wait
for the end of the event loop's current pass and leave together: the tokens one
provider read produced, or the requests one pass dispatched, cost one TLS record
and one system call, not one each. Any other send takes the waiting frames along,
in order. A frame over ``DEFER_AT_MOST`` is written at once even so: company saves it
nothing, and the sender's wait for the transport to drain then covers it (the edge
times a run's acknowledgement from when its order has left).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from loguru import logger

from iop_proto.errors import ConnectionClosed, HeartbeatTimeout, ProtocolError
from iop_proto.framing import (
    DEFAULT_FRAME_READ_TIMEOUT,
    DEFAULT_MAX_FRAME_SIZE,
    FrameBuffer,
    FrameReadTimeout,
    encode_frame,
)
from iop_proto.keepalive import enable_keepalive
from iop_proto.tls import PeerIdentity, peer_identity
from iop_proto.v1 import runtime_pb2 as pb

DEFAULT_HEARTBEAT_INTERVAL = 2.0  # a dead peer is judged within 3 x 2 s (the 10 s bound)
DEFAULT_MISSED_HEARTBEATS = 3
_CLOSE_TIMEOUT = 2.0
READ_SIZE = 64 * 1024  # per read: whatever has arrived, up to this
DEFER_AT_MOST = 64 * 1024
"""The largest frame a deferred send holds for the pass's others: asyncio's default
high-water mark, past which a frame would wait in the transport's buffer anyway."""


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
        frame_read_timeout: float | None = DEFAULT_FRAME_READ_TIMEOUT,
    ) -> None:
        """``frame_read_timeout``: seconds a frame's payload may take after its
        header (``None`` or 0: unbounded)."""
        self._reader = reader
        self._writer = writer
        self._sender_id = sender_id
        self._ids = itertools.count(1)
        self.max_frame_size = max_frame_size
        self.heartbeat_interval = heartbeat_interval
        self.missed_heartbeats = missed_heartbeats
        self.frame_read_timeout = frame_read_timeout
        self.peer: PeerIdentity | None = peer_identity(writer)
        enable_keepalive(writer.get_extra_info("socket"))
        self.peer_error: pb.Error | None = None  # the last error frame the peer sent
        self._last_received = time.monotonic()
        self._closed = asyncio.Event()
        self._fault: ProtocolError | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        # The frame being read: its payload's deadline (None between frames), the task
        # reading it and that task's cancel count then, and whether the watchdog cut it.
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it is used on
        self._frame_deadline: float | None = None
        self._frame_task: asyncio.Task[object] | None = None
        self._frame_cancelling = 0
        self._frame_expired = False
        self._frame_watchdog: asyncio.TimerHandle | None = None
        self._deferred: list[bytes] = []  # encoded frames waiting for the flush
        self._frames = FrameBuffer(max_frame_size)
        self._frame_started: float | None = None  # when the incomplete frame's header came

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
    def peer_address(self) -> str:
        """The peer's network address, ``host:port`` (``[host]:port`` for IPv6), as the
        socket sees it; ``peer_name`` is its certificate's name where there is one."""
        peername = self._writer.get_extra_info("peername")
        if not peername:
            return "unknown"
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

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
        if self._frame_watchdog is not None:
            self._frame_watchdog.cancel()
            self._frame_watchdog = None
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not self._writer.is_closing():
            with contextlib.suppress(ConnectionError, ProtocolError, OSError):
                if error is not None:
                    self._deferred.append(encode_frame(self.envelope(error), self.max_frame_size))
                self._flush_deferred()
        self._deferred.clear()
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError, TimeoutError, asyncio.TimeoutError):
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self._writer.wait_closed()

    def send_soon(self, body: object, *, correlation_id: str = "") -> None:
        """Send a small frame with this event-loop pass's others, without waiting for
        drain: for heartbeats and run acknowledgements, which must never block their
        caller (a peer that stopped reading would hold a ``drain()`` forever)."""
        if self._closed.is_set() or self._writer.is_closing():
            raise ConnectionClosed(f"connection to {self.peer_name} is closed") from self._fault
        envelope = self.envelope(body, correlation_id)
        self._deferred.append(encode_frame(envelope, self.max_frame_size))
        if len(self._deferred) == 1:
            self._running_loop().call_soon(self._flush_deferred)

    async def abort(self, fault: ProtocolError) -> None:
        """Close because of a protocol fault, telling the peer why."""
        if self._fault is None:
            self._fault = fault
        logger.warning("closing connection to {}: {}", self.peer_name, fault)
        await self.close(error_body(fault.code, str(fault)))

    # ------------------------------------------------------------ sending

    def envelope(self, body: object, correlation_id: str = "") -> pb.Envelope:
        """Wrap a body in a new envelope (its id is known before it is sent).

        The body goes in as a constructor argument: protobuf copies it in, in C.
        ``send`` builds its envelopes the same way, in place.
        """
        field = _BODY_FIELDS.get(type(body))
        if field is None:
            raise TypeError(f"{type(body).__name__} is not an Envelope body")
        oneof: dict[str, Any] = {field: body}  # the type checked just above
        return pb.Envelope(
            message_id=f"{self._sender_id}-{next(self._ids)}",
            correlation_id=correlation_id,
            sent_at_unix_ms=time.time_ns() // 1_000_000,
            **oneof,
        )

    async def send(
        self, body: object, *, correlation_id: str = "", defer: bool = False
    ) -> pb.Envelope:
        """Wrap a body message in an envelope (or take an ``Envelope`` made already, by
        ``envelope``), send it, and wait for drain; returns the envelope sent.

        ``defer``: leave with the other frames of this event-loop pass, unless the
        frame is over ``DEFER_AT_MOST`` (see above).
        """
        if self._closed.is_set() or self._writer.is_closing():
            raise ConnectionClosed(f"connection to {self.peer_name} is closed") from self._fault
        if type(body) is pb.Envelope:
            envelope = body
        else:
            field = _BODY_FIELDS.get(type(body))
            if field is None:
                raise TypeError(f"{type(body).__name__} is not an Envelope body")
            oneof: dict[str, Any] = {field: body}  # the type checked just above
            envelope = pb.Envelope(
                message_id=f"{self._sender_id}-{next(self._ids)}",
                correlation_id=correlation_id,
                sent_at_unix_ms=time.time_ns() // 1_000_000,
                **oneof,
            )
        frame = encode_frame(envelope, self.max_frame_size)
        if defer and len(frame) <= DEFER_AT_MOST:
            self._deferred.append(frame)
            if len(self._deferred) == 1:
                self._running_loop().call_soon(self._flush_deferred)
        elif self._deferred:
            self._deferred.append(frame)
            self._flush_deferred()
        else:
            self._writer.write(frame)
        # Returns at once unless the peer is behind (transport above its high-water mark).
        await self._writer.drain()
        return envelope

    async def send_envelope(self, envelope: pb.Envelope, *, defer: bool = False) -> None:
        """Send an envelope made already (``envelope``: its id was needed first)."""
        await self.send(envelope, defer=defer)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the connection is used on, kept from its first use: a connection
        belongs to one loop for its whole life."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _flush_deferred(self) -> None:
        """Write the waiting frames as one buffer (a no-op when a send took them along)."""
        if not self._deferred:
            return
        frames = self._deferred
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        frames.clear()
        if not self._writer.is_closing():
            self._writer.write(data)

    # ------------------------------------------------------------ receiving

    async def receive(self) -> pb.Envelope:
        """The next non-heartbeat envelope: one already read, or cut from what the
        stream delivers next.

        One ``read`` takes whatever has arrived, often several frames (a batch of
        tokens, a run's start with its end), and ``FrameBuffer`` cuts them out: no
        two exact-size reads per frame. A frame's payload must follow its header
        within ``frame_read_timeout`` (``_read_rest_of_frame``).

        Raises the typed ``ProtocolError`` after closing on a bad frame, and
        ``ConnectionClosed`` once the connection is gone for any other reason.
        """
        frames = self._frames
        while True:
            if self._closed.is_set():
                raise self._closed_error()
            try:
                envelope = frames.next_frame()
                while envelope is None:
                    if frames.partial and self.frame_read_timeout:
                        data = await self._read_rest_of_frame(self.frame_read_timeout)
                    else:
                        data = await self._reader.read(READ_SIZE)
                    if not data:
                        raise frames.end_of_stream()
                    # Bytes are the sign of life, not whole frames: a large frame on a
                    # slow link may take longer than the heartbeat verdict
                    # (``frame_read_timeout`` bounds it).
                    self._last_received = time.monotonic()
                    frames.feed(data)
                    envelope = frames.next_frame()
            except ProtocolError as fault:
                if self._closed.is_set():  # our own close cut the read short
                    raise self._closed_error() from None
                await self.abort(fault)
                raise
            except (ConnectionClosed, ConnectionError, OSError) as exc:
                await self.close()
                raise self._closed_error() from exc
            self._frame_started = None
            kind = envelope.WhichOneof("body")
            if kind == "heartbeat":
                continue
            if kind == "error":
                self.peer_error = envelope.error
            return envelope

    async def _read_rest_of_frame(self, timeout_s: float) -> bytes:
        """Read on while a frame is incomplete, until ``timeout_s`` after its header came.

        An ``asyncio.timeout`` per read costs more than reading a small frame, so
        one watchdog timer per connection is armed lazily instead and, when it fires,
        re-armed for the frame then in progress (if any); most frames arrive whole
        and the watchdog rarely exists. It cancels a late read, and the cancel is
        turned into ``FrameReadTimeout`` here, the way ``asyncio.timeout`` does it.
        """
        loop = self._running_loop()
        if self._frame_started is None:
            self._frame_started = loop.time()
        task = asyncio.current_task(loop)  # with the loop: a third of the cost without
        assert task is not None  # receive() always runs in a task
        self._frame_deadline = deadline = self._frame_started + timeout_s
        self._frame_task = task
        self._frame_cancelling = task.cancelling()
        if self._frame_watchdog is None:
            self._frame_watchdog = loop.call_at(deadline, self._frame_overdue)
        try:
            return await self._reader.read(READ_SIZE)
        except asyncio.CancelledError:
            # The watchdog's cancel becomes the typed fault; anyone else's stays a cancel.
            if self._frame_expired and task.uncancel() <= self._frame_cancelling:
                raise FrameReadTimeout(self._frames.frame_length, timeout_s) from None
            raise
        finally:
            self._frame_deadline = None
            self._frame_task = None
            self._frame_expired = False

    def _frame_overdue(self) -> None:
        """The watchdog: cancel the read of a late frame (``receive`` turns it into
        ``FrameReadTimeout``, as ``asyncio.timeout`` does). The reader itself is left
        alone: an exception set on it would also fail the writer's ``drain()``."""
        self._frame_watchdog = None
        deadline, task = self._frame_deadline, self._frame_task
        if deadline is None or task is None or self._closed.is_set():
            return  # between frames: the next header arms the watchdog again
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self._frame_watchdog = loop.call_at(deadline, self._frame_overdue)
            return
        self._frame_expired = True
        task.cancel()

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
        """Beat every interval; wake at the next beat or at the silence deadline, whichever
        comes first, so a dead peer is judged when the deadline passes, not up to an
        interval later. A beat never waits for drain (``send_soon``)."""
        interval = self.heartbeat_interval
        allowed_silence = interval * self.missed_heartbeats
        next_beat = time.monotonic() + interval
        while not self._closed.is_set():
            wake = min(next_beat, self._last_received + allowed_silence)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            silence = now - self._last_received
            if silence >= allowed_silence:
                await self._peer_dead(
                    HeartbeatTimeout(
                        f"no frame from {self.peer_name} for {silence:.1f}s "
                        f"({self.missed_heartbeats} heartbeats missed)"
                    )
                )
                return
            if now >= next_beat:
                next_beat = now + interval
                try:
                    self.send_soon(pb.Heartbeat(monotonic_ms=int(now * 1000)))
                except (ConnectionError, OSError):
                    await self.close()
                    return

    async def _peer_dead(self, fault: HeartbeatTimeout) -> None:
        """Abort the transport first: the read loop ends now, not after a TLS teardown a
        silent peer never completes (asyncio waits up to 30 s for its close_notify)."""
        if self._fault is None:
            self._fault = fault
        logger.warning("closing connection to {}: {}", self.peer_name, fault)
        with contextlib.suppress(ConnectionError, ProtocolError, OSError):
            # Handed to the kernel now, or never: a peer that is merely slow learns why.
            self._deferred.append(encode_frame(self.envelope(error_body(fault.code, str(fault)))))
            self._flush_deferred()
        self._deferred.clear()
        self._writer.transport.abort()
        await self.close()


def _body_fields() -> dict[type, str]:
    """Map each body message class to its field in the ``Envelope`` oneof."""
    oneof = pb.Envelope.DESCRIPTOR.oneofs_by_name["body"]
    fields: dict[type, str] = {}
    for field in oneof.fields:
        assert field.message_type is not None  # every body is a message
        fields[getattr(pb, field.message_type.name)] = field.name
    return fields


_BODY_FIELDS = _body_fields()
