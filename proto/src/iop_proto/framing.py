"""The wire format: ``[4-byte big-endian length][serialized Envelope]``.

Kept to one small module so every service reads and writes frames identically.
The maximum frame size is checked against the length prefix *before* reading the
payload, so a hostile length never makes us allocate or wait for it. Reading is
split into header and payload so a ``Connection`` can bound the time between
the two (``FrameReadTimeout``): a peer must not hold half a frame forever.
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


def decode_payload(payload: bytes) -> pb.Envelope:
    """Parse a frame's payload; an envelope without a body is as useless as garbage."""
    envelope = pb.Envelope()
    try:
        envelope.ParseFromString(payload)
    except DecodeError as exc:
        raise UnparsableFrame(f"payload of {len(payload)} bytes is not an Envelope: {exc}") from exc
    if envelope.WhichOneof("body") is None:
        raise UnparsableFrame(f"payload of {len(payload)} bytes carries no message body")
    return envelope


async def read_frame(
    reader: asyncio.StreamReader, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> pb.Envelope:
    """Read exactly one frame.

    Raises ``ConnectionClosed`` when the stream ends cleanly between frames,
    ``ShortRead`` when it ends inside one, ``FrameTooLarge`` and
    ``UnparsableFrame`` for bad frames.
    """
    length = await read_header(reader, max_frame_size)
    return await read_payload(reader, length)


async def read_header(
    reader: asyncio.StreamReader, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> int:
    """Read a frame's length prefix; the payload length, checked against the maximum."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise ConnectionClosed("peer closed the connection") from None
        raise ShortRead(HEADER.size, len(exc.partial)) from None
    (length,) = HEADER.unpack(header)
    if length > max_frame_size:
        raise FrameTooLarge(length, max_frame_size)
    return int(length)


async def read_payload(reader: asyncio.StreamReader, length: int) -> pb.Envelope:
    """Read and parse the ``length`` payload bytes that follow a header."""
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ShortRead(HEADER.size + length, HEADER.size + len(exc.partial)) from None
    return decode_payload(payload)


async def write_frame(
    writer: asyncio.StreamWriter,
    envelope: pb.Envelope,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
) -> None:
    """Write one frame and wait for the transport's buffer to drain (backpressure)."""
    writer.write(encode_frame(envelope, max_frame_size))
    await writer.drain()
