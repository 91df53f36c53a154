"""A node's life as an operator runs it, on a real stack: listed, retired, added again; and
the catalog following a change of a provider's served names.

Every step is the console script (`iop-control-plane node ...`, `config reload`) against
the running control-plane's database and pid file; what changed is read where a user reads
it: the edge's catalog, the node's own readiness, the API.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from iop_node.settings import NodeSettings
from iop_proto.service.settings import load_settings

pytestmark = pytest.mark.asyncio(loop_scope="module")


def fleet(renamed_served_as: str) -> dict[str, object]:
    """node-a serves mock-small and `renamed` (under ``renamed_served_as``), node-b
    mock-small too and b-only alone; node-fuzz is listed without providers."""
    served = {
        "node-a": {"node-a-mock": "mock-small", "node-a-rename": renamed_served_as},
        "node-b": {"node-b-mock": "small-b"},
        "node-fuzz": {},
    }
    providers = {
        node: [
            {"id": p, "type": "mock", "category": "api", "models": [name], "capacity": 2}
            for p, name in names.items()
        ]
        for node, names in served.items()
    }
    routes = {
        "mock-small": {"node-a-mock": "mock-small", "node-b-mock": "small-b"},
        "renamed": {"node-a-rename": renamed_served_as},
        "b-only": {"node-b-mock": "small-b"},
    }
    return {
        "models": [{"id": m, "providers": p} for m, p in routes.items()],
        "nodes": [{"id": n, "providers": p} for n, p in providers.items()],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(
        tmp_path_factory.mktemp("lifecycle"), fleet("before")
    ) as running:
        yield running


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 15) -> None:
    """Poll another process's state until ``check`` holds."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await asyncio.sleep(0.1)


async def catalog(stack: Any, kind: str, key: str) -> dict[str, dict[str, Any]]:
    """The edge's catalog of ``kind`` (providers, models), by each row's ``key``."""
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", f"/iop/v1/catalog/{kind}")
        async with http.get(url) as response:
            assert response.status == 200
            return {row[key]: row for row in (await response.json())["data"]}


async def providers(stack: Any) -> dict[str, dict[str, Any]]:
    return await catalog(stack, "providers", "provider_id")


async def models(stack: Any) -> dict[str, dict[str, Any]]:
    return await catalog(stack, "models", "id")


async def cli(stack: Any, *args: str) -> Any:
    return json.loads(await stack.control_plane_cli(*args, "--json"))


async def nodes(stack: Any) -> dict[str, dict[str, Any]]:
    return {row["node_id"]: row for row in await cli(stack, "node", "list")}


async def chat(stack: Any, model: str) -> int:
    async with aiohttp.ClientSession() as http:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with http.post(f"{stack.api_url}/chat/completions", json=body) as response:
            return response.status


async def test_catalog_follows_a_provider_s_new_served_name(stack: Any) -> None:
    """The provider's `models` and the model's served name change in the fleet file; after
    `config reload` (and again after the node restarts) the catalog names the new one,
    as the runs do."""
    stack.fleet_file.write_text(yaml.safe_dump(fleet("after")))
    await stack.control_plane_cli("config", "reload")

    async def renamed() -> bool:
        return (await providers(stack))["node-a-rename"]["models"] == ["after"]

    await eventually(renamed)
    assert await chat(stack, "renamed") == 200
    await stack.stop("node-a")
    await stack.start("node-a")
    await stack.wait_registered(("node-a",))
    await eventually(renamed)
    assert (await providers(stack))["node-a-rename"]["models"] == ["after"]


async def test_node_list_shows_what_the_edge_reports(stack: Any) -> None:
    async def reported() -> bool:
        listed = await nodes(stack)
        return listed["node-a"]["state"] == listed["node-b"]["state"] == "connected"

    await eventually(reported)
    listed = await nodes(stack)
    assert listed["node-a"]["edge_id"] == "edge"
    # Where the edge saw the connection come from: the node's address and port.
    assert re.fullmatch(r"127\.0\.0\.1:\d+", listed["node-a"]["peer_address"]), listed["node-a"]
    assert listed["node-a"]["in_fleet_file"] is True
    assert len(listed["node-a"]["live_tokens"]) == 1
    assert listed["node-fuzz"]["state"] == "never connected"
    assert listed["node-fuzz"]["live_tokens"] == []
    table = await stack.control_plane_cli("node", "list")
    assert re.search(r"^node-b\s+connected\s+yes\s+1\s+edge", table, re.MULTILINE), table


async def test_retired_node_leaves_the_catalog_and_its_token_is_refused(
    stack: Any, tmp_path: Path
) -> None:
    assert "node-b-mock" in await providers(stack)
    retired = await cli(stack, "node", "retire", "node-b")
    assert retired["node_id"] == "node-b"
    assert len(retired["revoked_token_ids"]) == 1
    assert retired["reload_signalled_pid"] == stack.services["control-plane"].process.pid
    assert retired["models_without_provider"] == ["b-only"]  # node-a still serves mock-small

    async def forgotten() -> bool:
        return "node-b-mock" not in await providers(stack)

    await eventually(forgotten)
    assert await chat(stack, "mock-small") == 200  # node-a still serves the model
    # The model node-b alone served stays listed, saying it has no provider.
    b_only = (await models(stack))["b-only"]
    assert b_only["providers"] == {}
    assert b_only["available"] is False
    assert "no provider serves it" in b_only["unavailable_reason"]
    assert (await models(stack))["mock-small"]["available"] is True

    # The node keeps dialling: every registration is refused, as retired (not as the
    # revoked token it presents), in the edge's log and in the node's own.
    async def refused() -> bool:
        return (await nodes(stack))["node-b"]["state"] == "retired"

    await eventually(refused)
    await stack.services["edge"].wait_for_line("(node_retired): node 'node-b' is retired")
    node_b = stack.services["node-b"]
    line = await node_b.wait_for_line("the edge refused the registration")
    assert "node 'node-b' is retired" in line
    assert "iop-control-plane node add node-b" in line
    async with aiohttp.ClientSession() as http:
        for _ in range(10):
            async with http.get(f"{node_b.admin_url}/readyz") as response:
                assert response.status != 200
            await asyncio.sleep(0.1)
    assert "node-b-mock" not in await providers(stack)

    # Added again: a new token file and the node's settings file, which the node loads as
    # it is, with the paths its host has (here the stack's).
    token_file = tmp_path / "node-b.token"
    settings_file = stack.root / "node-b.yaml"
    added = await cli(
        stack,
        "node",
        "add",
        "node-b",
        "--output",
        str(token_file),
        "--edge",
        f"127.0.0.1:{stack.node_port}",
        "--config-output",
        str(settings_file),
        "--force",
        "--node-certs-dir",
        str(stack.root / "pki"),
        "--node-token-path",
        str(token_file),
    )
    assert added["was_retired"] is True
    assert added["in_fleet_file"] is True
    assert added["config_file"] == str(settings_file)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text().startswith("iopnt_")
    settings = load_settings(NodeSettings, settings_file)
    assert settings.service_id == "node-b"
    assert (settings.edge.host, settings.edge.port) == ("127.0.0.1", stack.node_port)
    assert settings.token_file == token_file
    assert settings.tls.cert_file == stack.root / "pki" / "node-b.pem"
    assert settings.read_token() == token_file.read_text().strip()
    await stack.stop("node-b", signal.SIGTERM)
    # The port and the history file a real host has free: not so beside other tests.
    local = {"IOP_ADMIN__PORT": "0", "IOP_HISTORY_DB": str(tmp_path / "history.db")}
    await stack.start("node-b", env=local)
    await stack.wait_registered(("node-b",))
    assert (await providers(stack))["node-b-mock"]["connected"]
    assert (await nodes(stack))["node-b"]["state"] == "connected"

    async def served_again() -> bool:
        return (await models(stack))["b-only"]["available"] is True

    await eventually(served_again)
