"""Frame fuzzing against the edge's node port and the control-plane's edge port.

With valid certificates: oversize lengths, truncations, garbage protobuf, empty
envelopes and valid messages out of order each close their own connection
with an error frame; a registered connection then takes 100,000 valid frames
about unknown runs and providers without being dropped. No process dies and
the other connections keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import ssl
from collections import Counter
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed
from iop_proto.framing import HEADER, encode_frame, read_frame
from iop_proto.testing import open_client
from iop_proto.tls import client_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
BAD_CONNECTIONS = 120  # per port; each costs a TLS handshake
VOLUME_FRAMES = 100_000


def _valid(body: object) -> bytes:
    envelope = pb.Envelope(message_id="fuzz")
    field = {
        pb.RunEvent: "run_event",
        pb.CancelRequest: "cancel_request",
        pb.AuthorizeNodeRequest: "authorize_node_request",
        pb.ProviderSnapshot: "provider_snapshot",
        pb.LeaseRequest: "lease_request",
    }[type(body)]
    getattr(envelope, field).CopyFrom(body)
    return encode_frame(envelope)


def bad_frame(rng: random.Random) -> tuple[str, bytes, bool]:
    """(kind, bytes to send, whether the server can answer before we hang up)."""
    kind = rng.choice(["oversize", "garbage", "empty", "out_of_order", "mutated", "truncated"])
    if kind == "oversize":
        return kind, HEADER.pack(rng.randrange(16 * 1024 * 1024 + 1, 2**32)), True
    if kind == "garbage":
        payload = b"\xff" + rng.randbytes(rng.randrange(1, 200))
        return kind, HEADER.pack(len(payload)) + payload, True
    if kind == "empty":
        return kind, HEADER.pack(0), True
    if kind == "out_of_order":
        body = rng.choice(
            [pb.RunEvent(run_id="nope"), pb.CancelRequest(run_id="x"), pb.LeaseRequest()]
        )
        return kind, _valid(body), True
    frame = bytearray(_valid(pb.RunEvent(run_id="r" * rng.randrange(1, 50))))
    if kind == "mutated":
        for _ in range(rng.randrange(1, 6)):
            frame[rng.randrange(4, len(frame))] = rng.randrange(256)
        return kind, bytes(frame), False  # a mutation may still parse: then it is out of order
    return kind, bytes(frame[: rng.randrange(1, len(frame))]), False


async def fuzz_connection(
    port: int, context: ssl.SSLContext, data: bytes, wait_s: float
) -> pb.Envelope | None:
    """Send one bad frame; return the server's error frame (if it sent one before closing)."""
    reader, writer = await open_client(port, context)
    writer.write(data)
    await writer.drain()
    answer: pb.Envelope | None = None
    # Truncated frames make the server wait for the rest: hanging up is then the test.
    with contextlib.suppress(ConnectionClosed, TimeoutError, ConnectionError, ssl.SSLError):
        async with asyncio.timeout(wait_s):
            while answer is None:
                envelope = await read_frame(reader)
                if envelope.WhichOneof("body") == "error":
                    answer = envelope
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()
    return answer


async def run_bad_connections(port: int, context: ssl.SSLContext, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    for _ in range(BAD_CONNECTIONS):
        kind, data, answers = bad_frame(rng)
        # a frame the server cannot judge yet (cut short) waits for bytes that never come
        answer = await fuzz_connection(port, context, data, 5.0 if answers else 0.3)
        counts[kind] += 1
        if answers:
            assert answer is not None, f"no error frame for {kind}"
            assert answer.error.code in (
                pb.ERROR_CODE_BAD_FRAME,
                pb.ERROR_CODE_FRAME_TOO_LARGE,
                pb.ERROR_CODE_UNEXPECTED_MESSAGE,
            ), answer
            counts["error_frames"] += 1
    return counts


async def assert_stack_serves(stack: Stack) -> None:
    for name, service in stack.services.items():
        assert service.process.returncode is None, f"{name} died"
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as sdk:
        answer = await sdk.chat.completions.create(
            model="mock-small", messages=[{"role": "user", "content": "still there?"}], max_tokens=2
        )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 2


async def test_bad_frames_close_only_their_connection(stack: Stack) -> None:
    edge_counts = await run_bad_connections(
        stack.node_port, client_context(stack.tls("node-fuzz")), seed=1
    )
    cp_counts = await run_bad_connections(stack.cp_port, client_context(stack.tls("edge")), seed=2)
    print(f"\nedge node port: {dict(edge_counts)}\ncontrol-plane port: {dict(cp_counts)}")
    assert edge_counts["error_frames"] > BAD_CONNECTIONS // 2
    assert cp_counts["error_frames"] > BAD_CONNECTIONS // 2
    await assert_stack_serves(stack)


async def test_a_registered_connection_takes_100k_odd_but_valid_frames(stack: Stack) -> None:
    out = await stack.control_plane_cli("token", "issue", "--node", "node-fuzz")
    token = re.search(r"iopnt_\S+", out)
    assert token is not None
    reader, writer = await open_client(stack.node_port, client_context(stack.tls("node-fuzz")))
    async with Connection(reader, writer, sender_id="node-fuzz", heartbeat_interval=0) as conn:
        await conn.send(
            pb.RegisterRequest(peer_id="node-fuzz", token=token.group(0), role=pb.PEER_ROLE_NODE)
        )
        answer = await asyncio.wait_for(conn.receive(), 10)
        assert answer.register_response.accepted, answer
        rng = random.Random(3)
        frames = []
        for i in range(VOLUME_FRAMES):
            if i % 3:
                event = pb.RunEvent(run_id=f"unknown-{i}", sequence=rng.randrange(1000))
                event.delta.text = "x" * rng.randrange(0, 20)
                frames.append(_valid(event))
            else:
                snapshot = pb.ProviderSnapshot(node_id="node-fuzz")
                snapshot.providers.add(provider_id=f"ghost-{i % 50}", health=pb.HEALTH_AVAILABLE)
                frames.append(_valid(snapshot))
        for start in range(0, VOLUME_FRAMES, 1000):
            writer.write(b"".join(frames[start : start + 1000]))
            await writer.drain()
        # still registered: a round trip through the edge proves nothing was dropped
        await conn.send(pb.Heartbeat())
        assert not conn.closed
        print(f"\n{VOLUME_FRAMES} frames accepted on one registered connection")
    await assert_stack_serves(stack)
    edge_log = "".join(stack.services["edge"].log)
    assert "Traceback" not in edge_log
    # ghost providers never became routable
    assert "ghost-" not in str(await _catalog(stack))


async def _catalog(stack: Stack) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
        async with http.get(url) as response:
            return (await response.json())["data"]
