"""Only holders of the right certificate and token get in; every refusal is named,
logged and counted, and no token or key ever appears in a log."""

from __future__ import annotations

import asyncio
import datetime
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from iop_proto.connection import Connection
from iop_proto.testing import open_client, write_identity
from iop_proto.tls import TlsSettings, client_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def attempt_tls(port: int, context: ssl.SSLContext | None) -> str:
    """Connect and read: how did the server end it?"""
    try:
        reader, writer = await open_client(port, context)
    except (ssl.SSLError, ConnectionError) as exc:
        return f"handshake refused: {exc}"
    try:
        if context is None:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # plaintext on a TLS port
            await writer.drain()
        data = await asyncio.wait_for(reader.read(100), 10)
        return "closed" if not data or context is None else f"unexpected data {data!r}"
    except (ssl.SSLError, ConnectionError) as exc:
        return f"refused: {exc}"
    finally:
        writer.close()


async def register(
    stack: Any, tls: TlsSettings, node_id: str, token: str, role: int = pb.PEER_ROLE_NODE
) -> pb.RegisterResponse:
    reader, writer = await open_client(stack.node_port, client_context(tls))
    async with Connection(reader, writer, sender_id=node_id, heartbeat_interval=0) as conn:
        await conn.send(pb.RegisterRequest(peer_id=node_id, token=token, role=role))
        answer = await asyncio.wait_for(conn.receive(), 15)
        if answer.WhichOneof("body") == "error":
            return pb.RegisterResponse(accepted=False, reason=answer.error.message)
        return answer.register_response


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as response:
            return await response.text()


async def test_every_wrong_identity_is_refused_counted_and_never_leaks_a_secret(
    stack: Any, tmp_path: Path, report: Callable[[str], None]
) -> None:
    out = await stack.control_plane_cli("token", "issue", "--node", "node-fuzz")
    token = re.search(r"iopnt_\S+", out)
    assert token is not None
    fuzz_token = token.group(0)
    revoked_out = await stack.control_plane_cli("token", "issue", "--node", "node-fuzz")
    revoked = re.search(r"iopnt_\S+", revoked_out)
    revoked_id = re.search(r"tok_[0-9a-f]+", revoked_out)
    assert revoked is not None
    assert revoked_id is not None
    await stack.control_plane_cli("token", "revoke", revoked_id.group(0))
    key_out = await stack.control_plane_cli("key", "issue", "--name", "secret-test")
    api_key = re.search(r"sk-iop-\S+", key_out)
    assert api_key is not None

    anonymous = ssl.create_default_context(cafile=str(stack.tls("edge").ca_file))
    rogue = write_identity(trustme.CA(), tmp_path / "rogue", "node-fuzz", "node")
    rogue_tls = TlsSettings(
        ca_file=stack.tls("edge").ca_file, cert_file=rogue.cert_file, key_file=rogue.key_file
    )
    expired_cert = stack.ca.issue_cert(
        "127.0.0.1",
        "localhost",
        common_name="node-fuzz",
        organization_unit_name="node",
        not_before=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        not_after=datetime.datetime(2021, 1, 1, tzinfo=datetime.UTC),
    )
    expired_dir = tmp_path / "expired"
    expired_dir.mkdir()
    expired_cert.cert_chain_pems[0].write_to_path(str(expired_dir / "cert.pem"))
    expired_cert.private_key_pem.write_to_path(str(expired_dir / "key.pem"))
    expired_tls = TlsSettings(
        ca_file=stack.tls("edge").ca_file,
        cert_file=expired_dir / "cert.pem",
        key_file=expired_dir / "key.pem",
    )

    outcomes = {
        "no certificate": await attempt_tls(stack.node_port, anonymous),
        "another CA": await attempt_tls(stack.node_port, client_context(rogue_tls)),
        "expired certificate": await attempt_tls(stack.node_port, client_context(expired_tls)),
        "plaintext on the TLS port": await attempt_tls(stack.node_port, None),
    }
    for case, outcome in outcomes.items():
        assert outcome.startswith(("refused", "handshake refused", "closed")), (case, outcome)

    registrations = {
        "node-b's certificate as node-a": await register(
            stack, stack.tls("node-b"), "node-a", fuzz_token
        ),
        "a worker certificate on the node path": await register(
            stack, stack.tls("worker"), "worker", fuzz_token
        ),
        "a revoked token": await register(
            stack, stack.tls("node-fuzz"), "node-fuzz", revoked.group(0)
        ),
        "an unknown token": await register(
            stack, stack.tls("node-fuzz"), "node-fuzz", "iopnt_not-issued"
        ),
    }
    # The peer learns only that it was refused; the edge's log says why.
    expected = {
        "node-b's certificate as node-a": "does not match node id 'node-a'",
        "a worker certificate on the node path": "may not register as a node",
        "a revoked token": "was revoked",
        "an unknown token": "is not known",
    }
    edge_log = stack.services["edge"]
    for case, answer in registrations.items():
        assert not answer.accepted, case
        assert answer.reason == "registration refused (the edge's log says why)", case
        line = await asyncio.wait_for(edge_log.wait_for_line(expected[case]), 5)
        assert "at registration" in line, (case, line)
    assert (await register(stack, stack.tls("node-fuzz"), "node-fuzz", fuzz_token)).accepted

    edge_metrics = await metrics(stack.edge_admin)
    counted = {
        reason: re.search(
            rf'iop_edge_peer_refusals_total{{reason="{reason}",role="\w+",stage="(\w+)"}} (\d+)',
            edge_metrics,
        )
        for reason in (
            "no_certificate",
            "certificate_untrusted",
            "certificate_expired",
            "not_tls",
            "identity_mismatch",
            "wrong_role",
            "token_revoked",
            "unknown_token",
        )
    }
    report(
        "refusals counted: "
        + ", ".join(f"{r}={m.group(2) if m else 0}" for r, m in counted.items())
    )
    missing = [reason for reason, match in counted.items() if match is None]
    assert not missing, f"refusals not counted: {missing}\n{edge_metrics}"

    # no secret in any log of any service
    logs = "".join(line for service in stack.services.values() for line in service.log)
    for secret in (fuzz_token, revoked.group(0), api_key.group(0)):
        assert secret not in logs
