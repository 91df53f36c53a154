"""The fleet's CA rotated without a cut, against the real stack (processes, real mTLS).

The steps of docs/deploy-bare-metal.md ("Rotating the CA"), while a client sends requests
the whole time:

1. the fleet runs on CA1;
2. every service's trust bundle (``tls.ca_file``) becomes CA1 + CA2: the running edge and
   control-plane load it at their next handshake (``iop_proto.tls_reload``), no restart;
3. node-a is re-certified under CA2 and restarted while the edge still has its CA1
   certificate: its link comes up (each side trusts the other's CA), node-b serves
   meanwhile;
4. the edge, the control-plane and node-b are re-certified under CA2 (node-b restarted to
   link with its new certificate);
5. CA1 leaves the bundle: a node presenting a CA1-only certificate is refused.

No request fails on the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import trustme
from cryptography import x509
from openai import AsyncOpenAI

from iop_proto.testing import running_service, write_identity

pytestmark = pytest.mark.asyncio(loop_scope="module")


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 4,
        "max_queue": 8,
        "queue_timeout_ms": 20_000,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 500,
    }


FLEET: dict[str, object] = {
    "models": [
        {"id": "mock-small", "providers": {"node-a-mock": "small-a", "node-b-mock": "small-b"}}
    ],
    "nodes": [
        {"id": "node-a", "providers": [mock("node-a-mock", "small-a")]},
        {"id": "node-b", "providers": [mock("node-b-mock", "small-b")]},
        {"id": "node-fuzz", "providers": []},
    ],
}
ROLES = {"edge": "edge", "control-plane": "control-plane", "node-b": "node"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(Path(tmp_path_factory.mktemp("ca-rotation")), FLEET) as running:
        yield running


def replace(path: Path, data: bytes) -> None:
    """Write ``path`` as an operator's ``install`` does: a new file renamed over the old."""
    fresh = path.with_suffix(path.suffix + ".new")
    fresh.write_bytes(data)
    os.replace(fresh, path)


def recertify(pki: Path, ca: trustme.CA, name: str, role: str) -> None:
    """``name``'s certificate and key issued anew by ``ca`` (its ca.pem left as it is)."""
    staging = pki / "staging"
    write_identity(ca, staging, name, role)
    replace(pki / f"{name}.key", (staging / f"{name}.key").read_bytes())
    replace(pki / f"{name}.pem", (staging / f"{name}.pem").read_bytes())


def issuer(path: Path) -> x509.Name:
    return x509.load_pem_x509_certificate(path.read_bytes()).issuer


class Traffic:
    """Requests one after another until stopped; every failure kept."""

    def __init__(self, stack: Any) -> None:
        self._client = AsyncOpenAI(base_url=stack.api_url, api_key="none", max_retries=0)
        self.served = 0
        self.failures: list[BaseException] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self._client.chat.completions.create(
                    model="mock-small", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            except Exception as exc:
                self.failures.append(exc)
            else:
                self.served += 1

    async def served_more(self, than: int) -> None:
        async with asyncio.timeout(30):
            while self.served <= than:  # noqa: ASYNC110 - the requests run in this loop
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()

    async def aclose(self) -> None:
        await self._client.close()


async def test_the_ca_is_rotated_with_no_request_failed(stack: Any, tmp_path: Path) -> None:
    pki = stack.root / "pki"
    ca1, ca2 = stack.ca, trustme.CA()
    traffic = Traffic(stack)
    task = asyncio.create_task(traffic.run())
    try:
        await traffic.served_more(0)

        # 2. both CAs trusted everywhere (one bundle file is every service's ca_file here)
        replace(pki / "ca.pem", ca1.cert_pem.bytes() + ca2.cert_pem.bytes())

        # 3. node-a under CA2, the edge still on its CA1 certificate
        recertify(pki, ca2, "node-a", "node")
        assert issuer(pki / "node-a.pem") != issuer(pki / "edge.pem")
        await stack.stop("node-a")
        await stack.start("node-a")
        await stack.wait_registered(("node-a",), timeout_s=30)
        served = traffic.served
        await traffic.served_more(served + 5)

        # 4. every other service under CA2, one at a time
        for name, role in ROLES.items():
            recertify(pki, ca2, name, role)
        await stack.stop("node-b")
        await stack.start("node-b")
        await stack.wait_registered(("node-b",), timeout_s=30)
        await traffic.served_more(traffic.served + 5)

        # 5. CA1 removed: a certificate only CA1 signed is refused by the edge
        replace(pki / "ca.pem", ca2.cert_pem.bytes())
        await traffic.served_more(traffic.served + 5)
    finally:
        traffic.stop()
        await task
        await traffic.aclose()
    assert traffic.failures == []
    print(f"{traffic.served} requests served through the rotation, none failed")

    old = tmp_path / "old"
    write_identity(ca1, old, "node-fuzz", "node")
    replace(old / "ca.pem", ca2.cert_pem.bytes())  # it trusts the edge: only its own cert is old
    config = tmp_path / "node-fuzz.yaml"
    config.write_text(
        "\n".join(
            [
                "service_id: node-fuzz",
                "admin: {host: 127.0.0.1, port: 0}",
                f"tls: {{ca_file: {old / 'ca.pem'}, cert_file: {old / 'node-fuzz.pem'},"
                f" key_file: {old / 'node-fuzz.key'}}}",
                f"edge: {{host: 127.0.0.1, port: {stack.node_port}, server_name: localhost}}",
                "token: iopnt_never_sent_before_the_handshake",
                f"history_db: {tmp_path / 'fuzz.db'}",
                "reconnect: {initial_s: 0.1, max_s: 0.3}",
            ]
        )
    )
    async with running_service("iop-node", config) as node:
        line = await stack.services["edge"].wait_for_line("certificate_untrusted")
        assert "node-fuzz" in line or "127.0.0.1" in line
        await node.wait_for_line("it most likely rejected our certificate")
        with contextlib.suppress(ProcessLookupError):
            node.process.terminate()
