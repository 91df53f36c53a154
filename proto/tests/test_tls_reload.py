"""TLS contexts that load their files again when they change: real loopback mTLS, two CAs.

The CA rotation's passes (docs/deploy-bare-metal.md) on one server and one client, each
with its own files, with no context made again by the test: what each handshake admits
follows the files on disk.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import trustme

from iop_proto.testing import write_identity
from iop_proto.tls import TlsSettings, client_context, server_context


def identity(directory: Path, ca: trustme.CA, name: str, trusted: list[trustme.CA]) -> TlsSettings:
    """``name`` issued by ``ca`` into ``directory``, trusting ``trusted``: each file replaced
    by a rename, as ``install`` or an operator's copy does."""
    staging = directory / "staging"
    write_identity(ca, staging, name, "edge" if name == "edge" else "node")
    (staging / "ca.pem").write_bytes(b"".join(c.cert_pem.bytes() for c in trusted))
    for file in ("ca.pem", f"{name}.pem", f"{name}.key"):
        os.replace(staging / file, directory / file)
    return TlsSettings(
        ca_file=directory / "ca.pem",
        cert_file=directory / f"{name}.pem",
        key_file=directory / f"{name}.key",
    )


class Server:
    def __init__(self) -> None:
        self.accepted = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        writer.write(b"ok")
        await writer.drain()
        writer.close()


@pytest.fixture
def cas() -> tuple[trustme.CA, trustme.CA]:
    return trustme.CA(), trustme.CA()


async def test_each_handshake_follows_the_files_through_a_ca_rotation(
    tmp_path: Path, cas: tuple[trustme.CA, trustme.CA]
) -> None:
    ca1, ca2 = cas
    edge_dir, node_dir = tmp_path / "edge", tmp_path / "node"
    edge_dir.mkdir()
    node_dir.mkdir()
    server_tls = server_context(identity(edge_dir, ca1, "edge", [ca1]))
    client_tls = client_context(identity(node_dir, ca1, "node-a", [ca1]))
    server = Server()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=server_tls)
    port = listener.sockets[0].getsockname()[1]

    async def admitted() -> bool:
        """Whether the server admitted a new connection (with TLS 1.3 a client finishes
        its handshake before the server has checked its certificate: the server's
        answer is what tells)."""
        before = server.accepted
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_tls, server_hostname="localhost"
            )
        except OSError:  # ssl.SSLError is one: the client refused the server
            return False
        try:
            answer = await reader.read()
        except OSError:
            answer = b""
        writer.close()
        return answer == b"ok" and server.accepted == before + 1

    try:
        assert await admitted()  # 1. everyone on CA1
        identity(node_dir, ca2, "node-a", [ca1, ca2])
        assert not await admitted()  # the node on CA2 before the edge trusts CA2: refused
        identity(edge_dir, ca1, "edge", [ca1, ca2])
        assert await admitted()  # 2.+3. both CAs trusted: the CA2 node joins the CA1 edge
        identity(edge_dir, ca2, "edge", [ca2])
        assert await admitted()  # 4. the edge on CA2 alone, the node trusting both
        identity(node_dir, ca1, "node-a", [ca1, ca2])
        assert not await admitted()  # 5. a certificate of CA1 alone: refused
    finally:
        listener.close()
        await listener.wait_closed()


async def test_files_that_do_not_load_keep_the_last_ones(
    tmp_path: Path, cas: tuple[trustme.CA, trustme.CA]
) -> None:
    ca1, _ = cas
    settings = identity(tmp_path, ca1, "edge", [ca1])
    context = server_context(settings)
    assert settings.key_file is not None
    settings.key_file.write_bytes(b"not a key")  # a copy caught halfway
    assert context.current() is context  # the last good files stay in use
    identity(tmp_path, ca1, "edge", [ca1])
    assert context.current() is not context  # loaded once they do
