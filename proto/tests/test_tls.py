"""mTLS: only clients certified by the fleet CA get in; both sides learn who the other is."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest
import trustme

from iop_proto.connection import Connection
from iop_proto.errors import TlsConfigError
from iop_proto.testing import Pki, loopback_server, open_client, write_identity
from iop_proto.tls import (
    MINIMUM_VERSION,
    PeerIdentity,
    TlsSettings,
    client_context,
    peer_identity,
    server_context,
)
from iop_proto.v1 import runtime_pb2 as pb


async def refused(port: int, context: ssl.SSLContext) -> BaseException:
    """Connect and try to read: the server must refuse before any frame is exchanged."""
    try:
        reader, writer = await open_client(port, context)
    except (ssl.SSLError, ConnectionError) as exc:
        return exc
    try:
        data = await asyncio.wait_for(reader.read(1), 5)
        assert data == b"", "the server sent data to an unauthenticated client"
        return ConnectionResetError("closed without data")
    except (ssl.SSLError, ConnectionError) as exc:
        return exc
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


async def test_good_pair_exchanges_frames_and_identities(pki: Pki) -> None:
    seen_by_server: list[PeerIdentity | None] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            seen_by_server.append(conn.peer)
            request = await conn.receive()
            await conn.send(
                pb.RegisterResponse(accepted=True, edge_id="edge"),
                correlation_id=request.message_id,
            )

    async with loopback_server(handler, pki.server()) as port:
        reader, writer = await open_client(port, pki.client())
        async with Connection(reader, writer, sender_id="node-a", heartbeat_interval=0) as conn:
            assert conn.peer == PeerIdentity(name="edge", role="edge")
            sent = await conn.send(pb.RegisterRequest(peer_id="node-a", role=pb.PEER_ROLE_NODE))
            answer = await conn.receive()
    assert answer.register_response.accepted
    assert answer.correlation_id == sent.message_id
    assert seen_by_server == [PeerIdentity(name="node-a", role="node")]


async def test_client_without_certificate_is_refused(pki: Pki) -> None:
    called = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        called.set()

    anonymous = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki.edge.ca_file))
    async with loopback_server(handler, pki.server()) as port:
        error = await refused(port, anonymous)
    assert not called.is_set()
    assert isinstance(error, ssl.SSLError | ConnectionError)


async def test_client_from_another_ca_is_refused(pki: Pki, tmp_path: Path) -> None:
    called = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        called.set()

    rogue = write_identity(trustme.CA(), tmp_path, "node-a", "node")
    # The rogue client trusts the real CA (so it can verify the server), but its
    # own certificate comes from a CA the server does not know.
    rogue_with_real_trust = TlsSettings(
        ca_file=pki.edge.ca_file, cert_file=rogue.cert_file, key_file=rogue.key_file
    )
    async with loopback_server(handler, pki.server()) as port:
        error = await refused(port, client_context(rogue_with_real_trust))
    assert not called.is_set()
    assert isinstance(error, ssl.SSLError | ConnectionError)


async def test_client_refuses_server_from_another_ca(pki: Pki, tmp_path: Path) -> None:
    impostor = write_identity(trustme.CA(), tmp_path, "edge", "edge")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with loopback_server(handler, server_context(impostor)) as port:
        with pytest.raises(ssl.SSLCertVerificationError):
            await open_client(port, pki.client())


def test_contexts_require_certificates_and_tls_1_2(pki: Pki) -> None:
    for context in (pki.server(), pki.client()):
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.minimum_version == MINIMUM_VERSION == ssl.TLSVersion.TLSv1_2
    assert pki.client().check_hostname


def test_missing_files_fail_with_the_paths_named(tmp_path: Path) -> None:
    settings = TlsSettings(
        ca_file=tmp_path / "ca.pem", cert_file=tmp_path / "x.pem", key_file=tmp_path / "x.key"
    )
    with pytest.raises(TlsConfigError, match=r"x\.pem"):
        server_context(settings)


def test_enabled_tls_needs_all_three_files() -> None:
    with pytest.raises(ValueError, match="cert_file, key_file"):
        TlsSettings(ca_file=Path("ca.pem"))
    assert not TlsSettings(enabled=False).enabled


async def test_plaintext_stream_has_no_identity() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with loopback_server(handler, None) as port:
        _, writer = await open_client(port, None)
        assert peer_identity(writer) is None
        writer.close()
        await writer.wait_closed()
