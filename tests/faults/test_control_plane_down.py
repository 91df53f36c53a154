"""Control-plane down: the edge serves from its cached config, registrations fail closed,
and when it returns, config changes and revocations made meanwhile reach the edge."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from openai import AsyncOpenAI

from iop_proto.connection import Connection
from iop_proto.testing import open_client
from iop_proto.tls import client_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def register(stack: Any, node_id: str, token: str) -> pb.RegisterResponse:
    reader, writer = await open_client(stack.node_port, client_context(stack.tls(node_id)))
    async with Connection(reader, writer, sender_id=node_id, heartbeat_interval=0) as conn:
        await conn.send(pb.RegisterRequest(peer_id=node_id, token=token, role=pb.PEER_ROLE_NODE))
        answer = await asyncio.wait_for(conn.receive(), 15)
        return answer.register_response


async def chat(stack: Any) -> int:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as sdk:
        answer = await sdk.chat.completions.create(
            model="mock-small", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert answer.usage is not None
    return answer.usage.completion_tokens


async def control_plane_link_is(stack: Any, state: int) -> bool:
    """The edge's own word on its control-plane link (a gauge, not a log line)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.edge_admin}/metrics") as response:
            text = await response.text()
    return f"iop_edge_control_plane_connected {state:.1f}" in text


async def test_edge_serves_while_the_control_plane_is_away(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    out = await stack.control_plane_cli("token", "issue", "--node", "node-fuzz")
    fuzz_token = re.search(r"iopnt_\S+", out)
    assert fuzz_token is not None
    tokens = await stack.control_plane_cli("token", "list", "--json")
    node_b_token = next(t for t in yaml.safe_load(tokens) if t["node_id"] == "node-b")

    assert await stack.stop("control-plane") == 0

    await faults.eventually(lambda: control_plane_link_is(stack, 0), timeout_s=15)
    served = [await chat(stack) for _ in range(3)]
    report(f"served {len(served)} requests with the control-plane down")

    refused = await register(stack, "node-fuzz", fuzz_token.group(0))
    assert not refused.accepted
    assert refused.reason == "registration refused (the edge's log says why)"  # no more
    line = await asyncio.wait_for(
        stack.services["edge"].wait_for_line("(control_plane_unavailable)"), 5
    )
    assert "control-plane is unreachable" in line
    report(f"registration refused: {refused.reason}; the edge's log: {line.strip()}")

    # changes made while it was away: a new model, and node-b's token revoked (the CLI
    # writes the same database the control-plane serves from)
    fleet = yaml.safe_load(stack.fleet_file.read_text())
    fleet["models"].append({"id": "added-later", "providers": {"node-a-mock": "mock-small"}})
    stack.fleet_file.write_text(yaml.safe_dump(fleet))
    await stack.control_plane_cli("token", "revoke", node_b_token["token_id"])

    await stack.start("control-plane")

    async def node_b_dropped() -> bool:  # its token's revocation reached the edge
        rows = {r["provider_id"]: r for r in await faults.catalog(stack.api_url, "providers")}
        return not rows["node-b-mock"]["connected"]

    await faults.eventually(node_b_dropped, timeout_s=20)

    async def synced() -> bool:
        models = {m["id"] for m in await faults.catalog(stack.api_url, "models")}
        return "added-later" in models

    await faults.eventually(synced)
    assert await control_plane_link_is(stack, 1)  # the config came over a live link
    accepted = await register(stack, "node-fuzz", fuzz_token.group(0))
    assert accepted.accepted, accepted.reason
    assert accepted.takes_folded_completions  # the real edge reads a completion's start
    providers = {r["provider_id"]: r for r in await faults.catalog(stack.api_url, "providers")}
    assert not providers["node-b-mock"]["connected"]
    assert await chat(stack) == 2  # node-a still serves the pool


async def test_an_edge_started_with_no_config_serves_nobody_until_one_arrives(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    """A new edge (no cached config) whose control-plane does not answer cannot know
    whether keys are required: it refuses every request (503), loopback ones too, instead of
    serving them as the open API (every key's runs to whoever asks), until the config comes."""
    assert await stack.stop("control-plane") == 0
    assert await stack.stop("edge") == 0
    (stack.root / "edge-cache.pb").unlink()
    edge = await stack.start("edge")
    await asyncio.wait_for(edge.wait_for_line("no fleet config yet"), 10)
    with pytest.raises(openai.APIStatusError) as refused:
        await chat(stack)
    assert refused.value.status_code == 503
    assert "no fleet config yet" in refused.value.message
    runs = stack.api_url.replace("/v1", "/iop/v1/runs")
    async with aiohttp.ClientSession() as http, http.get(runs) as history:
        assert history.status == 503  # the fleet's history is nobody's before the config
    report(f"before its config the edge answered {refused.value.status_code}")

    await stack.start("control-plane")
    await asyncio.wait_for(edge.wait_for_line("serves loopback clients only"), 20)
    await stack.wait_registered(("node-a",))  # (node-b's token is revoked above)
    assert await chat(stack) == 2
