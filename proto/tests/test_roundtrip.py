"""Every message type of the contract survives the framing over a real loopback mTLS socket."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from iop_proto.connection import Connection
from iop_proto.testing import Pki, loopback_server, open_client
from iop_proto.v1 import runtime_pb2 as pb

_counter = itertools.count(1)


def populate(message: Message) -> Message:
    """Set every field of ``message`` (recursively) to a distinct non-default value.

    Built from the descriptors, so a field added to the contract is covered
    without touching this test.
    """
    descriptor: Descriptor = message.DESCRIPTOR
    for oneof in descriptor.oneofs:
        if oneof.name != "body":
            # a oneof holds one field at a time: set its first one
            _set(message, oneof.fields[0])
    for field in descriptor.fields:
        if field.containing_oneof is None:
            _set(message, field)
    return message


def _scalar(field: FieldDescriptor) -> object:
    n = next(_counter)
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{n} ünïcode"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return b'{"k": [1, 2.5, "x"], "n": ' + str(n).encode() + b"}"
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return field.enum_type.values[-1].number
    if field.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64):
        return -(2**40) - n
    return n  # unsigned and 32-bit integers


def _set(message: Message, field: FieldDescriptor) -> None:
    value = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value["provider-a"] = "served/a"
        value["provider-b"] = "served:b"
    elif field.message_type is not None:
        if field.is_repeated:
            populate(value.add())
            populate(value.add())
        else:
            populate(value)
    elif field.is_repeated:
        value.extend([_scalar(field), _scalar(field)])
    else:
        setattr(message, field.name, _scalar(field))


BODY_FIELDS = [f for f in pb.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields]


def body_of(field: FieldDescriptor) -> Message:
    assert field.message_type is not None
    return populate(getattr(pb, field.message_type.name)())


def test_every_body_is_covered() -> None:
    """The contract has every message ARCHITECTURE.md names (guards accidental removal)."""
    names = {f.name for f in BODY_FIELDS}
    required = {
        "register_request",
        "register_response",
        "heartbeat",
        "provider_snapshot",
        "run_request",
        "run_event",
        "cancel_request",
        "error",
    }
    assert required <= names


async def test_every_message_type_round_trips_over_mtls(pki: Pki) -> None:
    received: list[pb.Envelope] = []
    done = asyncio.Event()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            async for envelope in conn:
                received.append(envelope)
                await conn.send_envelope(envelope)
        done.set()

    sent: list[pb.Envelope] = []
    async with loopback_server(echo, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        async with Connection(reader, writer, sender_id="node-a", heartbeat_interval=0) as client:
            for field in BODY_FIELDS:
                if field.name == "heartbeat":
                    continue  # heartbeats are consumed by the connection, tested elsewhere
                sent.append(await client.send(body_of(field), correlation_id=f"run-{field.name}"))
                echoed = await client.receive()
                assert echoed == sent[-1]
        await asyncio.wait_for(done.wait(), 5)

    assert received == sent
    assert [e.WhichOneof("body") for e in received] == [
        f.name for f in BODY_FIELDS if f.name != "heartbeat"
    ]
    # the envelope header is filled by the connection
    assert all(e.message_id.startswith("node-a-") and e.sent_at_unix_ms > 0 for e in received)


@pytest.mark.parametrize("field", BODY_FIELDS, ids=lambda f: f.name)
def test_envelope_bytes_round_trip(field: FieldDescriptor) -> None:
    envelope = pb.Envelope(message_id="m", correlation_id="c", sent_at_unix_ms=1)
    getattr(envelope, field.name).CopyFrom(body_of(field))
    again = pb.Envelope.FromString(envelope.SerializeToString())
    assert again == envelope
    assert again.WhichOneof("body") == field.name


def test_request_parameters_travel_intact() -> None:
    """Parameters IOP does not interpret reach the provider byte for byte (ints stay ints)."""
    body = (
        b'{"model":"served","messages":[{"role":"user","content":"hi"}],"seed":42,'
        b'"logprobs":true,"response_format":{"type":"json_object"},"tools":[{"type":"function",'
        b'"function":{"name":"f","parameters":{"type":"object"}}}],"x_vendor":{"n":1}}'
    )
    envelope = pb.Envelope(run_request=pb.RunRequest(run_id="r", body_json=body))
    assert pb.Envelope.FromString(envelope.SerializeToString()).run_request.body_json == body
