"""Two real control-plane processes on one PostgreSQL database, as two hosts would run them.

A key or token issued with the CLI through one control-plane's settings reaches the
edges of the other within its credentials poll; with PostgreSQL down both keep their
edges and serve their last configuration, and what the CLI changes after the server
is back is pushed again. The edges here are edge-side clients over real mTLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trustme
import yaml
from pydantic import SecretStr

from iop_control_plane.adapters.postgres_store import PostgresCredentialStore
from iop_control_plane.domain.credentials import new_api_key
from iop_proto.connection import Connection
from iop_proto.postgres import PostgresSettings
from iop_proto.testing import (
    RunningService,
    open_client,
    refused_port,
    running_service,
    write_identity,
)
from iop_proto.testing_postgres import PostgresServer
from iop_proto.tls import TlsSettings, client_context
from iop_proto.v1 import runtime_pb2 as pb

PASSWORD = "pw-never-logged"  # trust auth ignores it; it must still show nowhere
FLEET = {
    "models": [{"id": "mock-small", "providers": {"node-a-mock": "mock-small"}}],
    "nodes": [
        {
            "id": "node-a",
            "providers": [
                {
                    "id": "node-a-mock",
                    "type": "mock",
                    "category": "local_inference",
                    "models": ["mock-small"],
                    "capacity": 2,
                }
            ],
        }
    ],
}
KEY = re.compile(r"sk-iop-[A-Za-z0-9_-]+")
TOKEN = re.compile(r"iopnt_[A-Za-z0-9_-]+")
TOKEN_ID = re.compile(r"tok_[0-9a-f]+")
Check = Callable[[pb.FleetConfig], bool]
DEADLINE_S = 30.0  # generous: the machine is shared; the figure printed is what counts


@dataclass
class Plane:
    """One control-plane process and the settings file its CLI shares."""

    name: str
    service: RunningService
    settings_file: Path
    edge_tls: TlsSettings

    async def cli(self, *args: str, expect: int = 0) -> tuple[str, str]:
        """The real ``iop-control-plane`` command with this control-plane's settings."""
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "iop-control-plane"),
            "--config",
            str(self.settings_file),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == expect, (out.decode(), err.decode())
        return out.decode(), err.decode()

    @contextlib.asynccontextmanager
    async def edge(self) -> AsyncIterator[Edge]:
        port = self.service.ports["edges"]
        reader, writer = await open_client(port, client_context(self.edge_tls))
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            edge = Edge(conn)
            edge.config = await edge.hello()
            yield edge


@dataclass
class Edge:
    """What an edge does on its control link: hello, then follow pushes and answers."""

    conn: Connection
    config: pb.FleetConfig | None = None

    async def hello(self) -> pb.FleetConfig:
        sent = await self.conn.send(pb.EdgeHello(edge_id="edge", version="test"))
        answer = await asyncio.wait_for(self.conn.receive(), DEADLINE_S)
        assert answer.correlation_id == sent.message_id
        return answer.fleet_config

    async def until_config(self, check: Check) -> pb.FleetConfig:
        """The config this edge holds once a push satisfies ``check``; the deadline fails."""
        assert self.config is not None
        async with asyncio.timeout(DEADLINE_S):
            while not check(self.config):
                envelope = await self.conn.receive()
                if envelope.WhichOneof("body") == "fleet_config":
                    self.config = envelope.fleet_config
        return self.config

    async def authorize(self, node_id: str, token: str) -> pb.AuthorizeNodeResponse:
        sent = await self.conn.send(
            pb.AuthorizeNodeRequest(node_id=node_id, token=token, certificate_identity=node_id)
        )
        async with asyncio.timeout(DEADLINE_S):
            while True:
                envelope = await self.conn.receive()
                if envelope.WhichOneof("body") == "fleet_config":
                    self.config = envelope.fleet_config
                elif envelope.correlation_id == sent.message_id:
                    return envelope.authorize_node_response


def _has_key(key_hash: str) -> Check:
    return lambda config: any(k.key_hash == key_hash for k in config.api_keys)


def _hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


@pytest.fixture
async def planes(tmp_path: Path, postgres_dsn: str) -> AsyncIterator[tuple[Plane, Plane]]:
    ca = trustme.CA()
    edge_tls = write_identity(ca, tmp_path / "pki", "edge", "edge")
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    dsn = postgres_dsn.replace("postgresql://iop@", f"postgresql://iop:{PASSWORD}@")
    assert PASSWORD in dsn
    async with contextlib.AsyncExitStack() as stack:
        started = []
        for name in ("cp-a", "cp-b"):  # as on two hosts: nothing shared but the database
            tls = write_identity(ca, tmp_path / "pki", name, "control-plane")
            settings_file = tmp_path / f"{name}.yaml"
            settings_file.write_text(
                yaml.safe_dump(
                    {
                        "service_id": name,
                        "admin": {"host": "127.0.0.1", "port": 0},
                        "fleet_file": str(fleet_file),
                        "database": str(tmp_path / name / "unused.db"),
                        "postgres": {"dsn": dsn, "connect_timeout_s": 2},
                        "listen": {"host": "127.0.0.1", "port": 0},
                        "credentials_poll_s": 0.25,  # the shipped default
                        "tls": {
                            "ca_file": str(tls.ca_file),
                            "cert_file": str(tls.cert_file),
                            "key_file": str(tls.key_file),
                        },
                    }
                )
            )
            service = await stack.enter_async_context(
                running_service("iop-control-plane", settings_file)
            )
            started.append(Plane(name, service, settings_file, edge_tls))
        yield started[0], started[1]
        for plane in started:
            assert PASSWORD not in "".join(plane.service.log), plane.name
            assert not (tmp_path / plane.name / "unused.db").exists()  # PostgreSQL only


async def test_a_key_issued_through_one_control_plane_reaches_the_other_ones_edges(
    planes: tuple[Plane, Plane], postgres_dsn: str
) -> None:
    a, b = planes
    dsn = postgres_dsn  # the same database the planes use (one per test)
    async with a.edge() as edge_a, b.edge() as edge_b:
        assert edge_b.config is not None
        assert list(edge_b.config.api_keys) == []
        started = time.monotonic()
        out, err = await a.cli("key", "issue", "--name", "app", "--models", "mock-small")
        cli_s = time.monotonic() - started
        [plaintext] = KEY.findall(out)
        assert PASSWORD not in out + err
        pushed = await edge_b.until_config(_has_key(_hash(plaintext)))
        [policy] = pushed.api_keys
        assert (policy.name, list(policy.models)) == ("app", ["mock-small"])
        assert plaintext not in str(pushed)
        await edge_a.until_config(_has_key(_hash(plaintext)))
        print(
            f"\nkey issued by cp-a's CLI ({cli_s:.2f} s to run) at cp-b's edge "
            f"{time.monotonic() - started:.2f} s after the command started"
        )

        # From the commit alone: as another host's CLI writes, timed to B's push.
        other_host = await PostgresCredentialStore.open(PostgresSettings(dsn=SecretStr(dsn)))
        try:
            direct = new_api_key("direct", [], 0, datetime.now(UTC))
            await other_host.add_api_key(direct.key)
            committed = time.monotonic()
            await edge_b.until_config(_has_key(direct.key.secret_hash))
            print(f"a committed key pushed by cp-b {time.monotonic() - committed:.3f} s later")
        finally:
            await other_host.aclose()

        # A node token issued through A is known to B, and B's revocation reaches A's edges.
        out, _ = await a.cli("token", "issue", "--node", "node-a")
        [token], [token_id] = TOKEN.findall(out), TOKEN_ID.findall(out)
        accepted = await edge_b.authorize("node-a", token)
        assert accepted.accepted, accepted.reason
        assert accepted.token_id == token_id
        await b.cli("token", "revoke", token_id)
        await edge_a.until_config(lambda c: token_id in c.revoked_token_ids)
        refused = await edge_a.authorize("node-a", token)
        assert not refused.accepted
        assert f"token {token_id} was revoked" in refused.reason
    listing, _ = await b.cli("key", "list", "--json")
    assert '"name": "app"' in listing
    assert plaintext not in listing


async def test_postgresql_down_keeps_edges_and_config_and_later_changes_still_propagate(
    planes: tuple[Plane, Plane], postgres_server: PostgresServer
) -> None:
    a, b = planes
    out, _ = await a.cli("key", "issue", "--name", "before")
    [before] = KEY.findall(out)
    out, _ = await a.cli("token", "issue", "--node", "node-a")
    [token] = TOKEN.findall(out)
    async with a.edge() as edge_a:
        served = await edge_a.until_config(_has_key(_hash(before)))
        postgres_server.down()
        try:
            for plane in planes:
                await asyncio.wait_for(
                    plane.service.wait_for_line("unreachable"), DEADLINE_S
                )  # each noticed, through its poll
            # The link stays up: a registration is refused as retry-later, not dropped.
            answer = await edge_a.authorize("node-a", token)
            assert not answer.accepted
            assert answer.reason_code == "storage_unavailable"
            assert "retry later" in answer.reason
            # A new edge (or one reconnecting) gets the last config from either plane.
            async with b.edge() as edge_b:
                assert edge_b.config is not None
                assert [k.key_hash for k in edge_b.config.api_keys] == [_hash(before)]
            _, err = await a.cli("key", "issue", "--name", "while-down", expect=1)
            assert "unreachable" in err
            assert PASSWORD not in err
        finally:
            postgres_server.up()
        for plane in planes:
            assert plane.service.process.returncode is None, plane.name
        started = time.monotonic()
        out, _ = await b.cli("key", "issue", "--name", "after")
        [after] = KEY.findall(out)
        pushed = await edge_a.until_config(_has_key(_hash(after)))
        print(
            f"\nafter the restart, cp-b's CLI change at cp-a's edge "
            f"{time.monotonic() - started:.2f} s after the command started"
        )
        assert pushed.version > served.version
        assert sorted(k.name for k in pushed.api_keys) == ["after", "before"]  # not "while-down"
        assert (await edge_a.authorize("node-a", token)).accepted  # the same link, all along
    for plane in planes:
        await asyncio.wait_for(plane.service.wait_for_line("reachable again"), DEADLINE_S)


async def test_a_control_plane_whose_store_is_unreachable_does_not_start(tmp_path: Path) -> None:
    """It cannot check a token without its store: one line saying so, exit 1, no secret."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    with refused_port() as port:
        settings_file = tmp_path / "cp.yaml"
        settings_file.write_text(
            yaml.safe_dump(
                {
                    "fleet_file": str(fleet_file),
                    "postgres": {"dsn": f"postgresql://iop:{PASSWORD}@127.0.0.1:{port}/iop"},
                    "admin": {"host": "127.0.0.1", "port": 0},
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "tls": {"enabled": False},
                }
            )
        )
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "iop-control-plane"),
            "--config",
            str(settings_file),
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(process.communicate(), 60)
    log = err.decode()
    assert process.returncode == 1, log
    assert "the PostgreSQL store is unreachable" in log
    assert "starts once its store answers" in log
    assert "Traceback" not in log
    assert PASSWORD not in log
