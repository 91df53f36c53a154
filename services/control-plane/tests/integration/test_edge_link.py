"""A real control-plane process and a real edge-side client over mTLS.

The edge receives the fleet configuration on connect, asks for node
authorizations, and receives pushes after a reload, a revocation or a new key.
Tokens and keys are made with the real CLI against the same SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import trustme
import yaml

from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed
from iop_proto.testing import RunningService, open_client, running_service, write_identity
from iop_proto.tls import TlsSettings, client_context
from iop_proto.v1 import runtime_pb2 as pb

FLEET = {
    "models": [
        {
            "id": "mock-small",
            "display_name": "Mock small",
            "providers": {"node-a-mock": "mock-small", "node-b-mock": "mock-small-b"},
        }
    ],
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
        },
        {
            "id": "node-b",
            "providers": [
                {
                    "id": "node-b-mock",
                    "type": "mock",
                    "category": "local_inference",
                    "models": ["mock-small-b"],
                    "capacity": 2,
                }
            ],
        },
    ],
}


@dataclass
class ControlPlane:
    service: RunningService
    settings_file: Path
    fleet_file: Path
    iop_port: int
    identities: dict[str, TlsSettings]

    async def cli(self, *args: str, expect: int = 0) -> tuple[str, str]:
        """Run the real ``iop-control-plane`` command against the same settings."""
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "iop-control-plane"),
            "--config",
            str(self.settings_file),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == expect, (out.decode(), err.decode())
        return out.decode(), err.decode()

    async def issue_token(self, node_id: str) -> tuple[str, str]:
        """Returns (token id, plaintext token)."""
        out, _ = await self.cli("token", "issue", "--node", node_id)
        plaintext = re.search(r"iopnt_[A-Za-z0-9_-]+", out)
        token_id = re.search(r"tok_[0-9a-f]+", out)
        assert plaintext is not None, out
        assert token_id is not None, out
        return token_id.group(0), plaintext.group(0)

    @contextlib.asynccontextmanager
    async def edge(self, identity: str = "edge") -> AsyncIterator[EdgeClient]:
        reader, writer = await open_client(self.iop_port, client_context(self.identities[identity]))
        async with Connection(reader, writer, sender_id=identity, heartbeat_interval=0) as conn:
            yield EdgeClient(conn)


@dataclass
class EdgeClient:
    """What an edge does on the link, keeping pushes apart from answers."""

    conn: Connection
    pushes: list[pb.FleetConfig] = field(default_factory=list)

    async def hello(self) -> pb.FleetConfig:
        sent = await self.conn.send(pb.EdgeHello(edge_id="edge", version="test"))
        answer = await asyncio.wait_for(self.conn.receive(), 10)
        assert answer.correlation_id == sent.message_id
        assert answer.WhichOneof("body") == "fleet_config"
        return answer.fleet_config

    async def authorize(
        self, node_id: str, token: str, identity: str | None = None
    ) -> pb.AuthorizeNodeResponse:
        request = pb.AuthorizeNodeRequest(
            node_id=node_id, token=token, certificate_identity=identity or node_id
        )
        sent = await self.conn.send(request)
        while True:
            envelope = await asyncio.wait_for(self.conn.receive(), 10)
            if envelope.WhichOneof("body") == "fleet_config":
                self.pushes.append(envelope.fleet_config)
            elif envelope.correlation_id == sent.message_id:
                return envelope.authorize_node_response

    async def next_push(self) -> pb.FleetConfig:
        if self.pushes:
            return self.pushes.pop(0)
        envelope = await asyncio.wait_for(self.conn.receive(), 10)
        assert envelope.WhichOneof("body") == "fleet_config", envelope
        return envelope.fleet_config


@pytest.fixture
async def control_plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    ca = trustme.CA()
    identities = {
        name: write_identity(ca, tmp_path / "pki", name, role)
        for name, role in [
            ("control-plane", "control-plane"),
            ("edge", "edge"),
            ("node-a", "node"),
        ]
    }
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    server_tls = identities["control-plane"]
    settings_file = tmp_path / "control-plane.yaml"
    settings_file.write_text(
        yaml.safe_dump(
            {
                "service_id": "control-plane",
                "admin": {"host": "127.0.0.1", "port": 0},
                "fleet_file": str(fleet_file),
                "database": str(tmp_path / "state" / "cp.db"),
                "listen": {"host": "127.0.0.1", "port": 0},
                "credentials_poll_s": 0.1,
                "tls": {
                    "ca_file": str(server_tls.ca_file),
                    "cert_file": str(server_tls.cert_file),
                    "key_file": str(server_tls.key_file),
                },
            }
        )
    )
    async with running_service("iop-control-plane", settings_file) as service:
        listening = next(line for line in service.log if "listening for edges" in line)
        port = int(listening.rsplit(":", 1)[1])
        yield ControlPlane(service, settings_file, fleet_file, port, identities)


async def test_edge_receives_the_fleet_on_connect(control_plane: ControlPlane) -> None:
    async with control_plane.edge() as edge:
        fleet = await edge.hello()
    assert fleet.version > 0
    assert [m.id for m in fleet.models] == ["mock-small"]
    assert dict(fleet.models[0].providers) == {
        "node-a-mock": "mock-small",
        "node-b-mock": "mock-small-b",
    }
    assert [n.node_id for n in fleet.nodes] == ["node-a", "node-b"]
    provider = fleet.nodes[0].providers[0]
    assert provider.capacity == 2
    assert provider.category == pb.PROVIDER_CATEGORY_LOCAL_INFERENCE


async def test_authorization_accepts_the_right_token_and_refuses_the_rest(
    control_plane: ControlPlane,
) -> None:
    token_id, token = await control_plane.issue_token("node-a")
    async with control_plane.edge() as edge:
        await edge.hello()

        accepted = await edge.authorize("node-a", token)
        assert accepted.accepted, accepted.reason
        assert accepted.token_id == token_id
        assert accepted.node_config.node_id == "node-a"
        assert [p.id for p in accepted.node_config.providers] == ["node-a-mock"]

        wrong = await edge.authorize("node-a", "iopnt_not-a-real-token")
        assert not wrong.accepted
        assert "not known" in wrong.reason

        other_node = await edge.authorize("node-b", token)
        assert not other_node.accepted
        assert "issued for node 'node-a', not 'node-b'" in other_node.reason

        mismatch = await edge.authorize("node-a", token, identity="node-b")
        assert not mismatch.accepted
        assert "certificate identity 'node-b' does not match node id 'node-a'" in mismatch.reason

        _, token_c = await control_plane.issue_token("node-c")
        not_in_fleet = await edge.authorize("node-c", token_c)
        assert not not_in_fleet.accepted
        assert "not in the fleet configuration" in not_in_fleet.reason

        await control_plane.cli("token", "revoke", token_id)
        push = await edge.next_push()  # the revocation reaches the connected edge
        assert token_id in push.revoked_token_ids
        revoked = await edge.authorize("node-a", token)
        assert not revoked.accepted
        assert f"token {token_id} was revoked" in revoked.reason

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{control_plane.service.admin_url}/metrics") as response:
            metrics = await response.text()
    for reason in (
        "accepted",
        "unknown_token",
        "token_of_another_node",
        "identity_mismatch",
        "node_not_in_fleet",
        "token_revoked",
    ):
        assert f'reason="{reason}"' in metrics, reason


async def test_reload_pushes_a_valid_file_and_keeps_the_old_config_for_a_bad_one(
    control_plane: ControlPlane,
) -> None:
    async with control_plane.edge() as edge:
        first = await edge.hello()

        fleet = yaml.safe_load(control_plane.fleet_file.read_text())
        fleet["models"].append({"id": "mock-b-only", "providers": {"node-b-mock": "mock-small-b"}})
        control_plane.fleet_file.write_text(yaml.safe_dump(fleet))
        out, _ = await control_plane.cli("config", "reload")
        assert "reload signalled" in out
        pushed = await edge.next_push()
        assert pushed.version > first.version
        assert [m.id for m in pushed.models] == ["mock-small", "mock-b-only"]

        fleet["models"].append({"id": "broken", "providers": {"no-such-provider": "x"}})
        control_plane.fleet_file.write_text(yaml.safe_dump(fleet))
        _, err = await control_plane.cli("config", "reload", expect=1)
        assert "models[broken].providers" in err
        assert "no-such-provider" in err
        # SIGHUP directly (the CLI refused to signal): the server refuses it too
        control_plane.service.process.send_signal(signal.SIGHUP)
        await asyncio.wait_for(control_plane.service.wait_for_line("fleet reload refused"), 10)
        _, token = await control_plane.issue_token("node-a")
        assert (await edge.authorize("node-a", token)).accepted
        assert edge.pushes == []  # nothing was pushed for the refused file

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{control_plane.service.admin_url}/v1/fleet") as response:
            view = await response.json()
    assert view["version"] == pushed.version
    assert "broken" not in str(view)


async def test_new_api_key_is_pushed_as_a_hash(control_plane: ControlPlane) -> None:
    async with control_plane.edge() as edge:
        await edge.hello()
        out, _ = await control_plane.cli(
            "key", "issue", "--name", "app", "--models", "mock-small", "--max-concurrent", "3"
        )
        plaintext = re.search(r"sk-iop-[A-Za-z0-9_-]+", out)
        assert plaintext is not None, out
        push = await edge.next_push()
    [policy] = push.api_keys
    assert policy.name == "app"
    assert list(policy.models) == ["mock-small"]
    assert policy.max_concurrent == 3
    assert policy.key_hash == hashlib.sha256(plaintext.group(0).encode()).hexdigest()
    assert plaintext.group(0) not in str(push)
    assert policy.operator is False


async def test_an_operator_key_is_pushed_with_its_flag(control_plane: ControlPlane) -> None:
    async with control_plane.edge() as edge:
        await edge.hello()
        await control_plane.cli("key", "issue", "--name", "console", "--operator")
        push = await edge.next_push()
    [policy] = push.api_keys
    assert (policy.name, policy.operator) == ("console", True)


async def test_a_keys_limits_are_pushed_to_the_edges(control_plane: ControlPlane) -> None:
    """Limits per key (issue 32) reach the edges in the fleet configuration, and a
    ``key update`` pushes them again."""
    async with control_plane.edge() as edge:
        await edge.hello()
        out, _ = await control_plane.cli(
            "key", "issue", "--name", "app", "--rpm", "30", "--budget", "900",
            "--budget-period", "week", "--weight", "4", "--priority", "2", "--json",
        )  # fmt: skip
        await edge.next_push()
        key_id = json.loads(out)["key_id"]
        await control_plane.cli("key", "update", key_id, "--model", "mock-small", "--rpm", "3")
        push = await edge.next_push()
    [policy] = push.api_keys
    assert policy.limits.requests_per_minute == 30
    assert (policy.limits.token_budget, policy.limits.budget_period) == (
        900,
        pb.BUDGET_PERIOD_WEEK,
    )
    assert (policy.weight, policy.priority) == (4, 2)
    [per_model] = policy.model_limits
    assert (per_model.model, per_model.limits.requests_per_minute) == ("mock-small", 3)


async def test_a_node_certificate_is_refused(control_plane: ControlPlane) -> None:
    async with control_plane.edge("node-a") as intruder:
        envelope = await asyncio.wait_for(intruder.conn.receive(), 10)
        assert envelope.error.code == pb.ERROR_CODE_PERMISSION_DENIED
        assert "edges only" in envelope.error.message
        with pytest.raises(ConnectionClosed):
            await intruder.conn.receive()


async def test_first_message_must_be_hello(control_plane: ControlPlane) -> None:
    async with control_plane.edge() as edge:
        await edge.conn.send(pb.AuthorizeNodeRequest(node_id="node-a", token="t"))
        envelope = await asyncio.wait_for(edge.conn.receive(), 10)
        assert envelope.error.code == pb.ERROR_CODE_UNEXPECTED_MESSAGE


async def test_sigterm_tells_each_edge_it_is_stopping_and_exits_0(
    control_plane: ControlPlane,
) -> None:
    """What docs/ARCHITECTURE.md's "Stopping" says of the control-plane: no drain (no work
    of its own to finish); each edge gets ``SHUTTING_DOWN`` and its session ends."""
    async with control_plane.edge() as edge:
        await edge.hello()
        control_plane.service.process.send_signal(signal.SIGTERM)
        said = await asyncio.wait_for(edge.conn.receive(), 10)
        assert said.WhichOneof("body") == "error", said
        assert said.error.code == pb.ERROR_CODE_SHUTTING_DOWN
        assert said.error.message == "control-plane is stopping"
        with pytest.raises(ConnectionClosed):  # and the session ends
            await asyncio.wait_for(edge.conn.receive(), 10)
    assert await asyncio.wait_for(control_plane.service.process.wait(), 30) == 0
    await control_plane.service.wait_for_line("stopped control-plane")


async def test_the_fleet_lists_the_edges_linked_now_with_their_node_listeners(
    control_plane: ControlPlane,
) -> None:
    """docs/ARCHITECTURE.md#several-edges: an edge that says where its node listener is
    is listed in every edge's config (its own first one included) until its link ends;
    one that does not say is not listed."""

    async def hello(
        edge: EdgeClient, edge_id: str, listener: pb.EdgeEndpoint | None
    ) -> list[tuple[str, str, int, str]]:
        said = pb.EdgeHello(edge_id=edge_id, version="test")
        if listener is not None:
            said.node_listener.CopyFrom(listener)
        sent = await edge.conn.send(said)
        answer = await asyncio.wait_for(edge.conn.receive(), 10)
        assert answer.correlation_id == sent.message_id
        return [(e.edge_id, e.host, e.port, e.server_name) for e in answer.fleet_config.edges]

    def listed(config: pb.FleetConfig) -> list[str]:
        return [e.edge_id for e in config.edges]

    a_at = pb.EdgeEndpoint(host="10.0.0.1", port=7000)
    b_at = pb.EdgeEndpoint(host="10.0.0.2", port=7001, server_name="edge-b.example")
    async with control_plane.edge() as a:
        assert await hello(a, "edge-a", a_at) == [("edge-a", "10.0.0.1", 7000, "")]
        async with control_plane.edge() as b:
            assert await hello(b, "edge-b", b_at) == [
                ("edge-a", "10.0.0.1", 7000, ""),
                ("edge-b", "10.0.0.2", 7001, "edge-b.example"),
            ]
            assert listed(await a.next_push()) == ["edge-a", "edge-b"]  # a hears of b
            async with control_plane.edge() as c:
                assert [e[0] for e in await hello(c, "edge-c", None)] == ["edge-a", "edge-b"]
        # edge-b's link ended: it is listed no more (edge-c was never listed)
        assert listed(await a.next_push()) == ["edge-a"]
