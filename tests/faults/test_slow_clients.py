"""Slowloris on both doors of the edge: slow clients are cut by read timeouts, others go on.

HTTP: a client that never sends its headers, one that sends them a byte at a
time and never finishes, and one whose body trickles in are each closed
within ``http.read_timeout_s`` (2 s here: the edge is restarted with it), while
a stream longer than that timeout completes on another connection, and so
does a large body sent slowly but steadily (above the 16 KiB/s floor) over
longer than the timeout.

The frame port (mTLS): a peer that completes the handshake and then sends
nothing, or half a register frame a byte at a time, is closed by the edge's
registration deadline (``REGISTER_TIMEOUT_S``, 10 s); a *registered* node that
starts a frame and trickles its payload is closed by the connection's frame
read timeout (``DEFAULT_FRAME_READ_TIMEOUT``, 30 s: the edge does not make it
a setting). Meanwhile the real nodes stay connected and requests are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed, ProtocolError
from iop_proto.framing import DEFAULT_FRAME_READ_TIMEOUT, HEADER, encode_frame
from iop_proto.testing import open_client
from iop_proto.tls import client_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="module")

READ_TIMEOUT_S = 2.0
REGISTER_TIMEOUT_S = 10.0  # the edge's node_listener.register_timeout_s (its default)
# How late a cut may come on a loaded machine: the lower bounds say no cut came early; the
# upper ones only that it was this timeout's, each far below the next timeout that could cut.
LATE_S = 5.0
TRICKLE_PAUSE_S = 0.25  # well under every timeout: each byte alone would keep a naive server


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 2,
        "max_queue": 2,
        "queue_timeout_ms": 5000,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 200,
    }


FLEET = {
    "models": [{"id": "mock-small", "providers": {"node-a-mock": "a", "node-b-mock": "b"}}],
    "nodes": [
        {"id": "node-a", "providers": [mock("node-a-mock", "a")]},
        {"id": "node-b", "providers": [mock("node-b-mock", "b")]},
        {"id": "node-fuzz", "providers": []},
    ],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(Path(tmp_path_factory.mktemp("slow")), FLEET) as running:
        # The shared fixture writes default settings: restart the edge with a short timeout.
        await running.stop("edge")
        settings_file = running.root / "edge.yaml"
        settings = yaml.safe_load(settings_file.read_text())
        settings["http"]["read_timeout_s"] = READ_TIMEOUT_S
        settings_file.write_text(yaml.safe_dump(settings))
        edge = await running.start("edge")
        running.edge_admin = edge.admin_url
        await running.wait_registered(("node-a", "node-b"))
        yield running


def api_address(stack: Any) -> tuple[str, int]:
    host, port = stack.api_url.removeprefix("http://").split("/", 1)[0].split(":")
    return host, int(port)


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One byte per pause until the peer hangs up (or the data runs out)."""
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        for index in range(len(data)):
            writer.write(data[index : index + 1])
            await writer.drain()
            await asyncio.sleep(TRICKLE_PAUSE_S)


async def seconds_until_closed(
    reader: asyncio.StreamReader, started: float, limit_s: float
) -> float:
    """Read (and drop) whatever comes until the peer closes; the time that took."""
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        async with asyncio.timeout(limit_s):
            while await reader.read(4096):
                pass
    return time.monotonic() - started


async def slow_http_client(stack: Any, kind: str) -> float:
    """Open a connection and misbehave; returns how long until the edge closed it."""
    host, port = api_address(stack)
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n" % host.encode()
    sender: asyncio.Task[None] | None = None
    if kind == "headers_trickled":
        writer.write(head)
        sender = asyncio.create_task(trickle(writer, b"X-Slow: " + b"z" * 200))
    elif kind == "body_trickled":
        writer.write(head + b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{")
        started = time.monotonic()  # the body's clock starts once the headers are in
        sender = asyncio.create_task(trickle(writer, b'"model":' + b" " * 391 + b"}"))
    # "silent": connected, and not one byte
    try:
        return await seconds_until_closed(reader, started, READ_TIMEOUT_S * 5)
    finally:
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def steady_upload(stack: Any) -> tuple[int, float]:
    """A 400 KiB body at 64 KiB/s (over 6 s): slow, yet no slowloris. Status and time."""
    host, port = api_address(stack)
    text = "steady " * (400 * 1024 // 7)
    body = json.dumps(
        {"model": "mock-small", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body))
        )
        for offset in range(0, len(body), 16 * 1024):
            writer.write(body[offset : offset + 16 * 1024])
            await writer.drain()
            await asyncio.sleep(0.25)
        status_line = await asyncio.wait_for(reader.readline(), 10)
        return int(status_line.split()[1]), time.monotonic() - started
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def long_stream(stack: Any, faults: Any) -> Any:
    """A well-behaved stream that lasts longer than the read timeout (600 tokens: 3 s)."""
    body = {"model": "mock-small", "messages": [{"role": "user", "content": "go"}]}
    long = {**body, "max_tokens": 600, "iop_mock": {"fill": True}}
    async with aiohttp.ClientSession() as http:
        return await faults.stream_chat(http, stack.api_url, long, 20)


async def test_slow_http_clients_are_cut_within_the_read_timeout(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    kinds = ("silent", "headers_trickled", "body_trickled")
    stream = asyncio.create_task(long_stream(stack, faults))
    upload = asyncio.create_task(steady_upload(stack))
    took = dict(
        zip(kinds, await asyncio.gather(*(slow_http_client(stack, k) for k in kinds)), strict=True)
    )
    outcome = await stream
    upload_status, upload_s = await upload
    # a keep-alive client idle for less than the timeout keeps its connection
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.get(f"{stack.api_url}/models") as response:
                assert response.status == 200
            await asyncio.sleep(READ_TIMEOUT_S / 2)
    report(
        f"read_timeout_s {READ_TIMEOUT_S:g}: cut after "
        + ", ".join(f"{kind} {seconds:.2f}s" for kind, seconds in took.items())
        + f"; alongside a {outcome.kind} stream of 3 s and a steady 400 KiB upload answered "
        f"{upload_status} after {upload_s:.1f}s"
    )
    for kind, seconds in took.items():
        assert READ_TIMEOUT_S - 0.1 <= seconds <= READ_TIMEOUT_S + LATE_S, (kind, seconds)
    assert outcome.kind == "completed", outcome
    assert upload_status == 200
    assert upload_s > 2 * READ_TIMEOUT_S  # it did take longer than one period
    assert "cut POST /v1/chat/completions" in "".join(stack.services["edge"].log)


@dataclass
class Cut:
    """How a misbehaving frame-port peer was closed."""

    seconds: float
    error: str  # the error frame's code, or "" when a reset overtook it


async def frame_port_client(stack: Any, kind: str, token: str) -> Cut:
    """Handshake as node-fuzz and misbehave until the edge closes the connection."""
    reader, writer = await open_client(stack.node_port, client_context(stack.tls("node-fuzz")))
    conn = Connection(reader, writer, sender_id="node-fuzz", heartbeat_interval=0)
    register = encode_frame(
        conn.envelope(pb.RegisterRequest(peer_id="node-fuzz", token=token, role=pb.PEER_ROLE_NODE))
    )
    sender: asyncio.Task[None] | None = None
    started = time.monotonic()
    try:
        if kind == "half_register_frame":
            # a real register frame, its payload a byte at a time: it would take ~30 s
            writer.write(register[: HEADER.size])
            sender = asyncio.create_task(trickle(writer, register[HEADER.size :]))
        elif kind == "registered_half_frame":
            await conn.send(
                pb.RegisterRequest(peer_id="node-fuzz", token=token, role=pb.PEER_ROLE_NODE)
            )
            answer = await asyncio.wait_for(conn.receive(), 10)
            assert answer.register_response.accepted, answer
            writer.write(HEADER.pack(1000))  # announces 1000 bytes, then trickles them
            started = time.monotonic()  # the frame's clock starts with its header
            sender = asyncio.create_task(trickle(writer, b"\0" * 1000))
        # "silent": the handshake, then nothing
        async with asyncio.timeout(DEFAULT_FRAME_READ_TIMEOUT + 10):  # not cut: the test fails
            error = await _until_closed(conn)
        return Cut(time.monotonic() - started, pb.ErrorCode.Name(error.code) if error else "")
    finally:
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        await conn.close()


async def _until_closed(conn: Connection) -> pb.Error | None:
    """Read until the edge closes; its error frame, unless our own trickle made the
    close a reset that dropped it (the peer was still sending when the edge hung up)."""
    with contextlib.suppress(ConnectionClosed, ProtocolError, ConnectionError, ssl.SSLError):
        while True:
            envelope = await conn.receive()
            if envelope.WhichOneof("body") == "error":
                return envelope.error
    return conn.peer_error


async def test_slow_frame_port_peers_are_cut(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    out = await stack.control_plane_cli("token", "issue", "--node", "node-fuzz")
    token = re.search(r"iopnt_\S+", out)
    assert token is not None
    kinds = ("silent", "half_register_frame", "registered_half_frame")
    cuts = asyncio.gather(*(frame_port_client(stack, k, token.group(0)) for k in kinds))
    # meanwhile: the real nodes stay registered and serve
    outcomes = [await long_stream(stack, faults) for _ in range(3)]
    took = dict(zip(kinds, await cuts, strict=True))
    report(
        "frame port: cut after "
        + ", ".join(
            f"{kind} {cut.seconds:.1f}s ({cut.error or 'reset before the error frame'})"
            for kind, cut in took.items()
        )
        + f"; register deadline {REGISTER_TIMEOUT_S:g}s, frame read timeout "
        f"{DEFAULT_FRAME_READ_TIMEOUT:g}s; streams alongside {[o.kind for o in outcomes]}"
    )
    for kind in ("silent", "half_register_frame"):
        seconds = took[kind].seconds
        assert REGISTER_TIMEOUT_S - 0.5 <= seconds <= REGISTER_TIMEOUT_S + LATE_S, (kind, took)
    seconds = took["registered_half_frame"].seconds
    assert DEFAULT_FRAME_READ_TIMEOUT - 0.5 <= seconds <= DEFAULT_FRAME_READ_TIMEOUT + LATE_S, took
    assert all(o.kind == "completed" for o in outcomes), outcomes
    providers = await faults.catalog(stack.api_url, "providers")
    assert all(p["connected"] for p in providers), providers
    log = "".join(stack.services["edge"].log)
    assert log.count("no register_request in time") >= 2  # the edge's own reasons
    assert "the 1000-byte payload of a frame did not arrive within 30s" in log
