"""`node add|retire|list` against a real SQLite file and fleet file (no server running:
the end-to-end run with one is tests/e2e/test_node_lifecycle.py)."""

from __future__ import annotations

import dataclasses
import io
import json
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from iop_control_plane.domain.credentials import hash_secret
from iop_control_plane.domain.nodes import NodeState
from iop_control_plane.entrypoints import node_commands
from iop_control_plane.entrypoints.main import _parser
from iop_control_plane.ports import OpenedCredentialStore

FLEET = {
    "models": [{"id": "m", "providers": {"gpu-1-mock": "m"}}],
    "nodes": [
        {
            "id": "gpu-1",
            "providers": [{"id": "gpu-1-mock", "type": "mock", "category": "api", "models": ["m"]}],
        }
    ],
}


@pytest.fixture
def context(tmp_path: Path) -> node_commands.NodeContext:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    return node_commands.NodeContext(fleet, tmp_path / "control-plane.pid")


async def run(
    store: OpenedCredentialStore, context: node_commands.NodeContext, *argv: str
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = _parser().parse_args(["node", *argv])
    code = await node_commands.run_command(args, store, context, out, err)
    return code, out.getvalue(), err.getvalue()


async def run_json(
    store: OpenedCredentialStore, context: node_commands.NodeContext, *argv: str
) -> Any:
    code, out, err = await run(store, context, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def expected_settings(node_id: str, edge: dict[str, object], token_file: str) -> dict[str, object]:
    """The node's settings file, with the guide's paths on the node's host."""
    return {
        "service_id": node_id,
        "admin": {"host": "127.0.0.1", "port": 9102},
        "tls": {
            "enabled": True,
            "ca_file": "/etc/iop/certs/ca.pem",
            "cert_file": f"/etc/iop/certs/{node_id}.pem",
            "key_file": f"/etc/iop/certs/{node_id}.key",
        },
        "edge": edge,
        "token_file": token_file,
        "history_db": "/var/lib/iop/node/history.db",
    }


async def test_add_writes_the_token_file_and_prints_only_the_node_settings_file(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    path = tmp_path / "gpu-1.token"
    code, out, err = await run(
        store, context, "add", "gpu-1", "--output", str(path), "--edge", "10.0.0.1:7000"
    )
    assert code == 0, err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text().strip()
    assert secret not in out
    token = await store.find_node_token(hash_secret(secret))
    assert token is not None
    assert token.node_id == "gpu-1"
    # stdout is the settings file, all of it YAML (`node add ... > node.yaml` saves it),
    # with the node host's paths; the rest is on stderr.
    edge = {"host": "10.0.0.1", "port": 7000}
    assert yaml.safe_load(out) == expected_settings("gpu-1", edge, "/etc/iop/certs/gpu-1.token")
    assert "--san edge=IP:10.0.0.1" in out  # the hint for dialling the edge by address
    assert "It lists gpu-1 with: gpu-1-mock (mock)" in out
    assert "lists 'gpu-1': it can register now" in err
    assert str(path) in err


async def test_add_writes_the_node_settings_file_with_the_node_host_s_paths(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    config = tmp_path / "gpu-1.yaml"
    argv = ["add", "gpu-1", "--output", str(tmp_path / "t"), "--config-output", str(config)]
    code, out, err = await run(
        store, context, *argv, "--edge", "edge.example:7443", "--node-certs-dir", "/srv/iop"
    )
    assert code == 0, err
    assert f"settings file to {config}" in out
    assert "service_id" not in out
    edge = {"host": "edge.example", "port": 7443}
    expected = expected_settings("gpu-1", edge, "/srv/iop/gpu-1.token")
    expected["tls"] = {
        "enabled": True,
        "ca_file": "/srv/iop/ca.pem",
        "cert_file": "/srv/iop/gpu-1.pem",
        "key_file": "/srv/iop/gpu-1.key",
    }
    assert yaml.safe_load(config.read_text()) == expected
    assert stat.S_IMODE(config.stat().st_mode) == 0o644  # no secret in it
    # Not overwritten without --force; the token path on the node's host is its own option.
    code, _, err = await run(store, context, *argv, "--edge", "edge.example:7443")
    assert code == 1
    assert f"{config} exists" in err
    code, _, err = await run(
        store, context, *argv, "--edge", "h:1", "--force", "--node-token-path", "/run/t"
    )
    assert code == 0, err
    assert yaml.safe_load(config.read_text())["token_file"] == "/run/t"


async def test_add_writes_no_settings_file_without_the_edge(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    config = tmp_path / "gpu-1.yaml"
    argv = ["add", "gpu-1", "--output", str(tmp_path / "t"), "--config-output", str(config)]
    code, _, err = await run(store, context, *argv)
    assert code == 1
    assert "--edge" in err
    assert not config.exists()
    assert await store.list_node_tokens() == []


async def test_add_of_a_node_the_fleet_lacks_says_what_to_add(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    added = await run_json(store, context, "add", "gpu-2", "--output", str(tmp_path / "t"))
    assert added["in_fleet_file"] is False
    assert added["node_config"]["edge"] == {"host": "EDGE_HOST", "port": 7000}
    code, out, err = await run(store, context, "add", "gpu-2", "--output", str(tmp_path / "u"))
    assert code == 0
    assert "does not list 'gpu-2' yet" in err
    assert "config reload" in err
    # The settings file's last comment is the fleet entry to add, as YAML once uncommented.
    example = out.split("e.g.\n", 1)[1]
    entry = yaml.safe_load("\n".join(line[1:] for line in example.splitlines()))
    assert entry[0]["id"] == "gpu-2"
    assert entry[0]["providers"][0]["type"] == "mock"
    assert yaml.safe_load(out)["edge"] == {"host": "EDGE_HOST", "port": 7000}


async def test_add_refuses_to_overwrite_a_token_file(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    path = tmp_path / "t"
    path.write_text("iopnt_in_use\n")
    code, _, err = await run(store, context, "add", "gpu-1", "--output", str(path))
    assert code == 1
    assert "--force" in err
    assert path.read_text() == "iopnt_in_use\n"
    assert await store.list_node_tokens() == []


async def test_retire_revokes_every_token_and_add_admits_the_node_again(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    for name in ("a", "b"):
        await run_json(store, context, "add", "gpu-1", "--output", str(tmp_path / name))
    retired = await run_json(store, context, "retire", "gpu-1")
    assert len(retired["revoked_token_ids"]) == 2
    assert retired["models_without_provider"] == ["m"]  # gpu-1 was its only provider
    assert retired["reload_signalled_pid"] is None  # no server runs here
    assert retired["in_fleet_file"] is True
    assert all(t.revoked for t in await store.list_node_tokens())
    assert set(await store.retired_nodes()) == {"gpu-1"}
    listed = {row["node_id"]: row for row in await run_json(store, context, "list")}
    assert listed["gpu-1"]["state"] == "retired"
    assert listed["gpu-1"]["live_tokens"] == []
    code, out, _ = await run(store, context, "retire", "gpu-1")
    assert code == 0
    assert "retired since" in out  # a repeat keeps the first time
    assert "still lists 'gpu-1'" in out
    assert "Models left with no provider: m." in out

    added = await run_json(store, context, "add", "gpu-1", "--output", str(tmp_path / "c"))
    assert added["was_retired"] is True
    assert await store.retired_nodes() == {}


async def test_retire_says_which_control_planes_apply_it(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    """No server on this host: with its own SQLite file it applies the retirement when it
    starts; with the shared PostgreSQL store every running control-plane applies it."""
    await run_json(store, context, "add", "gpu-1", "--output", str(tmp_path / "t"))
    code, out, _ = await run(store, context, "retire", "gpu-1")
    assert code == 0
    assert "No running control-plane found" in out
    assert "it applies this when it starts" in out
    shared = dataclasses.replace(context, shared_store=True)
    code, out, _ = await run(store, shared, "retire", "gpu-1")
    assert code == 0
    assert "No running control-plane found" not in out
    assert "Every control-plane on the shared store applies this" in out


async def test_retire_of_an_unknown_node_fails(
    store: OpenedCredentialStore, context: node_commands.NodeContext
) -> None:
    code, _, err = await run(store, context, "retire", "nobody")
    assert code == 1
    assert "no node 'nobody'" in err
    assert await store.retired_nodes() == {}


async def test_list_shows_the_state_an_edge_reported(
    store: OpenedCredentialStore, context: node_commands.NodeContext, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    await run_json(store, context, "add", "gpu-1", "--output", str(tmp_path / "t"))
    await store.record_node_states(
        [
            NodeState("gpu-1", "edge-1", True, "tok_1", now, "10.0.0.2:4000", "", now),
            NodeState(
                "old", "edge-1", False, "tok_2", now, "10.0.0.3:4000", "heartbeat timeout", now
            ),
        ]
    )
    rows = {row["node_id"]: row for row in await run_json(store, context, "list")}
    assert rows["gpu-1"]["state"] == "connected"
    assert rows["gpu-1"]["edge_id"] == "edge-1"
    assert rows["gpu-1"]["in_fleet_file"] is True
    assert len(rows["gpu-1"]["live_tokens"]) == 1
    assert rows["old"]["state"] == "disconnected"
    assert rows["old"]["detail"] == "heartbeat timeout"
    assert rows["old"]["in_fleet_file"] is False
    code, table, _ = await run(store, context, "list")
    assert code == 0
    assert table.splitlines()[0].split() == [
        "NODE",
        "STATE",
        "IN_FLEET",
        "TOKENS",
        "EDGE",
        "SINCE",
        "FROM",
        "DETAIL",
    ]
    assert "heartbeat timeout" in table
