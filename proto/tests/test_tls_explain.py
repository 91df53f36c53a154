"""What each side of a failed mTLS handshake says, from real handshakes on real sockets.

The listener is ``StreamServer`` (the edge's and the control-plane's); the dialler uses
``tls_explain.rejection`` as the node, the worker and the edge's control link do.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme

from iop_proto.accept import StreamServer
from iop_proto.testing import Pki, write_identity
from iop_proto.tls import TlsRefused, TlsSettings, client_context, server_context
from iop_proto.tls_explain import PEER_CLOSED_REASON, TlsMismatch, rejection


class Listener:
    def __init__(self) -> None:
        self.refusals: list[TlsRefused] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    def refused(self, exc: TlsRefused, peer: object) -> None:
        self.refusals.append(exc)


@pytest.fixture
async def edge(pki: Pki) -> AsyncIterator[tuple[Listener, int]]:
    listener = Listener()
    server = StreamServer(listener.handle, server_context(pki.edge), listener.refused)
    port = await server.start("127.0.0.1", 0)
    try:
        yield listener, port
    finally:
        server.close()
        await server.wait_closed()


async def dial(port: int, settings: TlsSettings, name: str) -> TlsMismatch | None:
    """One dial as the node makes it; the mismatch it would stop with, or None."""
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context(settings), server_hostname=name
        )
    except ssl.SSLCertVerificationError as exc:
        return await rejection(
            exc,
            host="127.0.0.1",
            port=port,
            server_name=name,
            settings=settings,
            peer="edge",
            setting="edge",
            timeout_s=5,
        )
    writer.write(b"x")
    writer.close()
    return None


async def until_refused(listener: Listener) -> TlsRefused:
    async with asyncio.timeout(5):
        while not listener.refusals:  # noqa: ASYNC110 - the server's own task reports it
            await asyncio.sleep(0.01)
    return listener.refusals[0]


async def test_an_address_the_certificate_lacks_is_named_with_what_it_has(
    pki: Pki, edge: tuple[Listener, int]
) -> None:
    listener, port = edge
    mismatch = await dial(port, pki.node, "10.0.0.1")
    assert mismatch is not None
    assert str(mismatch) == (
        "the edge's certificate is not valid for 10.0.0.1: it names IP:127.0.0.1, "
        "DNS:localhost; set edge.server_name to one of those, or reissue it with "
        "devcerts --san edge=IP:10.0.0.1"
    )
    refusal = await until_refused(listener)
    assert refusal.reason == PEER_CLOSED_REASON
    assert "the peer closed during the TLS handshake" in refusal.detail


async def test_an_edge_certificate_from_another_ca_names_our_ca_file(
    pki: Pki, edge: tuple[Listener, int], tmp_path: Path
) -> None:
    _, port = edge
    stranger = write_identity(trustme.CA(), tmp_path, "node-a", "node")
    mismatch = await dial(port, stranger, "localhost")
    assert mismatch is not None
    assert f"not signed by the CA in our tls.ca_file ({stranger.ca_file})" in str(mismatch)


async def test_the_listener_says_why_it_rejected_an_expired_certificate(
    pki: Pki, edge: tuple[Listener, int], tmp_path: Path
) -> None:
    listener, port = edge
    old = pki.ca.issue_cert(
        "localhost",
        common_name="node-a",
        organization_unit_name="node",
        not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
    )
    old.cert_chain_pems[0].write_to_path(str(tmp_path / "old.pem"))
    old.private_key_pem.write_to_path(str(tmp_path / "old.key"))
    expired = TlsSettings(
        ca_file=pki.edge.ca_file, cert_file=tmp_path / "old.pem", key_file=tmp_path / "old.key"
    )
    assert await dial(port, expired, "localhost") is None  # TLS 1.3: the client saw no error
    refusal = await until_refused(listener)
    assert refusal.reason == "certificate_expired"
    assert refusal.detail.startswith("its certificate has expired: reissue it")
