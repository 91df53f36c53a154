"""The wire format: ``[4-byte big-endian length][serialized Envelope]``.

Kept to one small module so every service reads and writes frames identically.
The maximum frame size is checked against the length prefix *before* reading the
payload, so a hostile length never makes us allocate or wait for it. A
``Connection`` cuts frames out of what it reads (``FrameBuffer``) and bounds the
time from a frame's header to its last byte (``FrameReadTimeout``): a peer must
not hold half a frame forever. ``read_frame`` reads one frame from a stream.
"""

from __future__ import annotations

import asyncio
import struct

from google.protobuf.message import DecodeError

from iop_proto.errors import (
    ConnectionClosed,
    FrameTooLarge,
    ProtocolError,
    ShortRead,
    UnparsableFrame,
)
from iop_proto.v1 import runtime_pb2 as pb

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
DEFAULT_FRAME_READ_TIMEOUT = 30.0
"""Seconds a frame's payload may take once its header arrived (16 MiB at ~0.5 MiB/s)."""
COMPACT_AFTER = 1024 * 1024  # consumed bytes a FrameBuffer keeps before moving the rest
ANSWER_HEADROOM = 64 * 1024
"""Bytes of a frame kept free of an engine's answer: the run event around it (ids,
usage, finish reason) with plenty to spare, as the edge keeps for a request's body."""


def max_answer_bytes(max_frame_size: int) -> int:
    """The most bytes of an engine's answer (a non-streamed body, one streamed event) a
    node carries to the edge: what fits in one frame beside the run event around it."""
    return max(max_frame_size - ANSWER_HEADROOM, max_frame_size // 2)


DEFAULT_MAX_ANSWER_BYTES = max_answer_bytes(DEFAULT_MAX_FRAME_SIZE)


class FrameReadTimeout(ProtocolError, TimeoutError):
    """A frame's header arrived but its payload did not follow in time (a slowloris peer).

    A bad frame like a short read: the connection closes with a ``BAD_FRAME``
    error frame. The wait *between* frames is not bounded by it; heartbeats
    judge an idle peer.
    """

    def __init__(self, length: int, timeout_s: float) -> None:
        super().__init__(
            f"the {length}-byte payload of a frame did not arrive within {timeout_s:g}s"
        )
        self.length = length
        self.timeout_s = timeout_s


def encode_frame(envelope: pb.Envelope, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Serialize one envelope with its length prefix.

    Refusing oversize frames on the sending side too means a peer never has to
    close the connection because of something we could have known.
    """
    payload = envelope.SerializeToString()
    if len(payload) > max_frame_size:
        raise FrameTooLarge(len(payload), max_frame_size)
    return HEADER.pack(len(payload)) + payload


class FrameBuffer:
    """Bytes as a stream delivered them, cut into frames.

    A ``Connection`` reads whatever has arrived (one ``read``, often several frames:
    a batch of tokens, a start with its run's end) and takes the frames out here,
    instead of two exact-size reads per frame. The length prefix is still checked
    before any payload is waited for.
    """

    __slots__ = ("_data", "_max_frame_size", "_pos", "partial")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._data = bytearray()
        self._pos = 0  # where the next frame starts in _data
        self._max_frame_size = max_frame_size
        self.partial = False
        """Whether the last ``next_frame`` found a header without all of its payload
        (``in_frame`` as of then: what a reader waits for next is the timed part)."""

    def feed(self, data: bytes) -> None:
        if self._pos == len(self._data):  # all consumed: start over, nothing to move
            self._data.clear()
            self._pos = 0
        elif self._pos > COMPACT_AFTER:
            del self._data[: self._pos]
            self._pos = 0
        self._data += data

    def next_frame(self) -> pb.Envelope | None:
        """The next whole frame's envelope, or ``None`` until more bytes arrive.

        Raises ``FrameTooLarge`` as soon as a length prefix is over the maximum and
        ``UnparsableFrame`` for a payload that is no envelope.
        """
        data, pos = self._data, self._pos
        if len(data) - pos < HEADER.size:
            self.partial = False
            return None
        (length,) = HEADER.unpack_from(data, pos)
        if length > self._max_frame_size:
            raise FrameTooLarge(length, self._max_frame_size)
        end = pos + HEADER.size + length
        if len(data) < end:
            self.partial = True
            return None
        self._pos = end
        # The slice is the one copy: protobuf parses a bytearray as it parses bytes,
        # and keeps nothing of it.
        payload = data[pos + HEADER.size : end]
        envelope = pb.Envelope()
        try:
            # The stubs say bytes; the C (upb) parser reads any buffer.
            envelope.ParseFromString(payload)  # type: ignore[arg-type]
        except DecodeError as exc:
            raise UnparsableFrame(f"payload of {length} bytes is not an Envelope: {exc}") from exc
        # an envelope without a body is as useless as garbage
        if envelope.WhichOneof("body") is None:
            raise UnparsableFrame(f"payload of {length} bytes carries no message body")
        return envelope

    @property
    def in_frame(self) -> bool:
        """A frame's header is here but not all of its payload (the timed part)."""
        return len(self._data) - self._pos >= HEADER.size

    @property
    def frame_length(self) -> int:
        """The payload length of the frame in progress (0 without a whole header)."""
        if not self.in_frame:
            return 0
        return int(HEADER.unpack_from(self._data, self._pos)[0])

    def end_of_stream(self) -> ProtocolError | ConnectionClosed:
        """What the stream ending now means: a clean close between frames, or a short read."""
        held = len(self._data) - self._pos
        if held == 0:
            return ConnectionClosed("peer closed the connection")
        if held < HEADER.size:
            return ShortRead(HEADER.size, held)
        (length,) = HEADER.unpack_from(self._data, self._pos)
        return ShortRead(HEADER.size + length, held)


async def read_frame(
    reader: asyncio.StreamReader, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> pb.Envelope:
    """Read exactly one frame, cut out by a ``FrameBuffer`` as a connection's frames are:
    its header first, whose length is checked before the payload is waited for.

    Raises ``ConnectionClosed`` when the stream ends cleanly between frames,
    ``ShortRead`` when it ends inside one, ``FrameTooLarge`` and
    ``UnparsableFrame`` for bad frames.
    """
    frames = FrameBuffer(max_frame_size)
    try:
        frames.feed(await reader.readexactly(HEADER.size))
        envelope = frames.next_frame()  # a payload follows, unless the frame is empty
        if envelope is None:
            frames.feed(await reader.readexactly(frames.frame_length))
            envelope = frames.next_frame()
    except asyncio.IncompleteReadError as exc:
        frames.feed(exc.partial)
        raise frames.end_of_stream() from None
    assert envelope is not None  # the whole frame was read
    return envelope


async def write_frame(
    writer: asyncio.StreamWriter,
    envelope: pb.Envelope,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
) -> None:
    """Write one frame and wait for the transport's buffer to drain (backpressure)."""
    writer.write(encode_frame(envelope, max_frame_size))
    await writer.drain()
