"""The decoder on bad input: a typed error every time, never a hang or another exception."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_proto.errors import (
    ConnectionClosed,
    FrameTooLarge,
    ProtocolError,
    ShortRead,
    UnparsableFrame,
)
from iop_proto.framing import HEADER, FrameBuffer, encode_frame, read_frame
from iop_proto.v1 import runtime_pb2 as pb

MAX = 64 * 1024


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def valid_frame(text: str = "hello") -> bytes:
    envelope = pb.Envelope(run_event=pb.RunEvent(run_id="r", delta=pb.RunDelta(text=text)))
    return encode_frame(envelope)


async def read_all(data: bytes) -> list[pb.Envelope]:
    """Read frames until the stream ends; a bad frame raises its typed error."""
    reader = reader_of(data)
    frames = []
    while True:
        try:
            frames.append(await read_frame(reader, MAX))
        except ConnectionClosed:
            return frames


async def test_frames_back_to_back_decode_in_order() -> None:
    frames = await read_all(valid_frame("a") + valid_frame("b") + valid_frame("c"))
    assert [f.run_event.delta.text for f in frames] == ["a", "b", "c"]


async def test_length_over_maximum_is_refused_before_reading_the_payload() -> None:
    # only the header is sent: the decoder must not wait for 4 GiB of payload
    with pytest.raises(FrameTooLarge) as info:
        await asyncio.wait_for(read_frame(reader_of(HEADER.pack(2**32 - 1)), MAX), 1)
    assert info.value.length == 2**32 - 1
    assert info.value.maximum == MAX


def test_encoder_refuses_oversize_frames() -> None:
    envelope = pb.Envelope(run_request=pb.RunRequest(body_json=b"x" * (MAX + 1)))
    with pytest.raises(FrameTooLarge):
        encode_frame(envelope, MAX)


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 10])
async def test_truncated_frame_is_a_short_read(cut: int) -> None:
    frame = valid_frame("truncated")
    with pytest.raises(ShortRead):
        await read_all(frame[:cut])


async def test_valid_length_with_garbage_payload_is_unparsable() -> None:
    garbage = b"\xff\xff\xff\xff\x0f garbage"
    with pytest.raises(UnparsableFrame):
        await read_all(HEADER.pack(len(garbage)) + garbage)


async def test_empty_envelope_is_unparsable() -> None:
    with pytest.raises(UnparsableFrame, match="no message body"):
        await read_all(HEADER.pack(0))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
async def test_random_bytes_give_frames_or_a_typed_error(data: bytes) -> None:
    try:
        frames = await asyncio.wait_for(read_all(data), 1)
    except ProtocolError:
        return
    assert all(f.WhichOneof("body") for f in frames)


@settings(max_examples=300, deadline=None)
@given(
    st.data(),
    st.sampled_from(["truncate", "flip", "length", "insert"]),
)
async def test_mutated_valid_frames_give_frames_or_a_typed_error(
    data: st.DataObject, mutation: str
) -> None:
    frame = bytearray(valid_frame("mutate me") + valid_frame("second"))
    position = data.draw(st.integers(0, len(frame) - 1))
    if mutation == "truncate":
        frame = frame[:position]
    elif mutation == "flip":
        frame[position] ^= data.draw(st.integers(1, 255))
    elif mutation == "length":
        frame[0:4] = HEADER.pack(data.draw(st.integers(0, 2**32 - 1)))
    else:
        frame[position:position] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        frames = await asyncio.wait_for(read_all(bytes(frame)), 1)
    except ProtocolError:
        return
    assert all(f.WhichOneof("body") for f in frames)


@given(st.binary(max_size=256))
def test_a_payload_decodes_or_raises_nothing_else(payload: bytes) -> None:
    frames = FrameBuffer(MAX)
    frames.feed(HEADER.pack(len(payload)) + payload)
    try:
        envelope = frames.next_frame()
    except UnparsableFrame:
        return
    assert envelope is not None
    assert envelope.WhichOneof("body") is not None


@settings(max_examples=200)
@given(
    texts=st.lists(st.text(max_size=300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_frame_buffer_cuts_the_same_frames_however_the_bytes_arrive(
    texts: list[str], cuts: list[int]
) -> None:
    stream = b"".join(valid_frame(text) for text in texts)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    buffer = FrameBuffer(MAX)
    got: list[str] = []
    for start, end in itertools.pairwise(bounds):
        buffer.feed(stream[start:end])
        while (envelope := buffer.next_frame()) is not None:
            got.append(envelope.run_event.delta.text)
    assert got == texts
    assert isinstance(buffer.end_of_stream(), ConnectionClosed)  # nothing left over


def test_frame_buffer_judges_the_length_before_the_payload_and_names_short_reads() -> None:
    too_long = FrameBuffer(MAX)
    too_long.feed(HEADER.pack(MAX + 1))
    with pytest.raises(FrameTooLarge):
        too_long.next_frame()

    half = FrameBuffer(MAX)
    frame = valid_frame("x" * 50)
    half.feed(frame[:2])
    assert (half.next_frame(), half.in_frame) == (None, False)
    assert isinstance(half.end_of_stream(), ShortRead)  # inside the header
    half.feed(frame[2:10])
    assert (half.next_frame(), half.in_frame, half.frame_length) == (None, True, len(frame) - 4)
    short = half.end_of_stream()
    assert isinstance(short, ShortRead)
    assert str(len(frame)) in str(short)  # the frame's whole size is named

    garbage = FrameBuffer(MAX)
    garbage.feed(HEADER.pack(3) + b"\xff\xff\xff" + valid_frame())
    with pytest.raises(UnparsableFrame):
        garbage.next_frame()
