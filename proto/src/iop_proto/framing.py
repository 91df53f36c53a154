"""The wire format: ``[4-byte big-endian length][serialized Envelope]``.

Kept to one small module so every service reads and writes frames identically.
The maximum frame size is checked against the length prefix *before* reading the
payload, so a hostile length never makes us allocate or wait for it.
"""

from __future__ import annotations

import asyncio
import struct

from google.protobuf.message import DecodeError

from iop_proto.errors import ConnectionClosed, FrameTooLarge, ShortRead, UnparsableFrame
from iop_proto.v1 import runtime_pb2 as pb

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024


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
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise ConnectionClosed("peer closed the connection") from None
        raise ShortRead(HEADER.size, len(exc.partial)) from None
    (length,) = HEADER.unpack(header)
    if length > max_frame_size:
        raise FrameTooLarge(length, max_frame_size)
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
