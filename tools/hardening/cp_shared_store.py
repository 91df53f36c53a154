"""Two control-planes, as on two hosts: does a key issued through one reach the other's edges?

    .venv/bin/python tools/hardening/cp_shared_store.py [CHECKOUT] [--samples N]

Starts a throwaway PostgreSQL cluster (Debian's server, ``iop_proto.testing_postgres``)
and two ``iop-control-plane`` processes from ``CHECKOUT``'s sources (default: this one),
each with its own SQLite file and pid file, as on two hosts, and a ``postgres`` section
naming one database. A checkout that refuses that section (before the control-plane's
PostgreSQL store) is run without it: one SQLite file per host, what it could do. An
edge-side client holds a link to each. ``--samples`` times: ``key issue`` through cp-a's
CLI, and the seconds from the command's start until cp-b pushes the key to its edge (or
"never" within 10 s). Then, where the store is shared, PostgreSQL is stopped: whether
both edges keep their links and are answered, then started again and the seconds until
a key issued after it reaches cp-b's edge.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import trustme
import yaml

from iop_proto.connection import Connection
from iop_proto.testing import RunningService, open_client, running_service, write_identity
from iop_proto.testing_postgres import PostgresServer, running_postgres
from iop_proto.tls import TlsSettings, client_context
from iop_proto.v1 import runtime_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCES = ("proto/src", "services/control-plane/src")
FLEET = {
    "models": [{"id": "m", "providers": {"n-p": "m"}}],
    "nodes": [
        {
            "id": "n",
            "providers": [
                {"id": "n-p", "type": "mock", "category": "local_inference", "models": ["m"]}
            ],
        }
    ],
}
NEVER_S = 10.0
KEY = re.compile(r"sk-iop-[A-Za-z0-9_-]+")


def _settings(directory: Path, name: str, tls: TlsSettings, dsn: str | None) -> Path:
    settings: dict[str, object] = {
        "service_id": name,
        "admin": {"host": "127.0.0.1", "port": 0},
        "fleet_file": str(directory / "fleet.yaml"),
        "database": str(directory / name / "credentials.db"),
        "listen": {"host": "127.0.0.1", "port": 0},
        "tls": {
            "ca_file": str(tls.ca_file),
            "cert_file": str(tls.cert_file),
            "key_file": str(tls.key_file),
        },
    }
    if dsn is not None:
        settings["postgres"] = {"dsn": dsn, "connect_timeout_s": 2}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


async def _cli(settings: Path, *args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iop-control-plane"),
        "--config",
        str(settings),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


@contextlib.asynccontextmanager
async def _edge(service: RunningService, tls: TlsSettings) -> AsyncIterator[Connection]:
    reader, writer = await open_client(service.ports["edges"], client_context(tls))
    async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
        await conn.send(pb.EdgeHello(edge_id="edge", version="probe"))
        await asyncio.wait_for(conn.receive(), 10)
        yield conn


async def _until_key(conn: Connection, key_hash: str, limit_s: float) -> bool:
    try:
        async with asyncio.timeout(limit_s):
            while True:
                envelope = await conn.receive()
                config = envelope.fleet_config
                if any(k.key_hash == key_hash for k in config.api_keys):
                    return True
    except TimeoutError:
        return False


async def _issue_and_wait(settings: Path, conn: Connection) -> float | None:
    """Seconds from ``key issue``'s start until ``conn`` is pushed the key; None: never."""
    started = time.monotonic()
    code, out = await _cli(settings, "key", "issue", "--name", "probe")
    if code != 0:
        return None
    [plaintext] = KEY.findall(out)
    digest = hashlib.sha256(plaintext.encode()).hexdigest()
    if not await _until_key(conn, digest, NEVER_S):
        return None
    return time.monotonic() - started


async def _authorized_answer(conn: Connection) -> str:
    """Ask for an authorization; what comes back: a refusal code, or the link's end."""
    sent = await conn.send(
        pb.AuthorizeNodeRequest(node_id="n", token="t", certificate_identity="n")
    )
    try:
        async with asyncio.timeout(NEVER_S):
            while True:
                envelope = await conn.receive()
                if envelope.correlation_id == sent.message_id:
                    answer = envelope.authorize_node_response
                    return f"answered ({answer.reason_code or 'accepted'})"
    except Exception as exc:  # the figure: what an edge sees
        return f"link lost ({type(exc).__name__})"


async def _start(stack: contextlib.AsyncExitStack, settings: Path) -> RunningService | str:
    try:
        return await stack.enter_async_context(running_service("iop-control-plane", settings))
    except RuntimeError as exc:
        return str(exc).splitlines()[-1].strip()


async def measure(samples: int, server: PostgresServer) -> None:
    with tempfile.TemporaryDirectory(prefix="iop-cp-shared-") as tmp:
        directory = Path(tmp)
        (directory / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
        ca = trustme.CA()
        edge_tls = write_identity(ca, directory / "pki", "edge", "edge")
        dsn: str | None = server.create_database()
        async with contextlib.AsyncExitStack() as stack:
            services: list[RunningService] = []
            for name in ("cp-a", "cp-b"):
                tls = write_identity(ca, directory / "pki", name, "control-plane")
                started = await _start(stack, _settings(directory, name, tls, dsn))
                if isinstance(started, str):
                    print(f"{name} refuses the postgres section: {started}")
                    print("  -> one SQLite file per host instead (no shared store)")
                    dsn = None
                    started = await _start(stack, _settings(directory, name, tls, None))
                    assert not isinstance(started, str), started
                services.append(started)
            print(f"store: {'one PostgreSQL database' if dsn else 'a SQLite file per host'}")
            cp_a = directory / "cp-a.yaml"
            async with (
                _edge(services[0], edge_tls) as edge_a,
                _edge(services[1], edge_tls) as edge_b,
            ):
                seen = [await _issue_and_wait(cp_a, edge_b) for _ in range(samples)]
                times = [s for s in seen if s is not None]
                print(
                    f"key issued via cp-a's CLI at cp-b's edge: {len(times)}/{samples} within "
                    f"{NEVER_S:.0f} s"
                    + (
                        f"; from the command's start median {statistics.median(times):.2f} s, "
                        f"max {max(times):.2f} s"
                        if times
                        else ""
                    )
                )
                if dsn is None:
                    return
                server.down()
                try:
                    await asyncio.sleep(2)  # a figure, not a test: let both polls see it
                    answers = [await _authorized_answer(c) for c in (edge_a, edge_b)]
                    print(f"PostgreSQL down: edge links {answers}")
                    alive = [s.process.returncode is None for s in services]
                    print(f"PostgreSQL down: control-planes running {alive}")
                finally:
                    server.up()
                after = await _issue_and_wait(cp_a, edge_b)
                print(
                    "after the restart, a key via cp-a's CLI at cp-b's edge: "
                    + (f"{after:.2f} s from the command's start" if after else "never")
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=ROOT)
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    os.environ["PYTHONPATH"] = os.pathsep.join(str(checkout / s) for s in SOURCES)
    print(f"checkout: {checkout}")
    with running_postgres() as server:
        asyncio.run(measure(args.samples, server))


if __name__ == "__main__":
    main()
