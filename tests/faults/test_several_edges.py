"""Two edges serve one fleet (docs/ARCHITECTURE.md#several-edges), every process real.

The stack's nodes and worker are configured with the first edge only; they learn the
second from the list the control-plane gives every edge, and link to it too. SIGKILL
the first edge: requests through the second keep completing (only those the first
carried are lost), and the nodes' links to the first come back when it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from iop_proto.connection import Connection
from iop_proto.testing import open_client
from iop_proto.tls import client_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
NODES = ("node-a", "node-b")
HELLO = [{"role": "user", "content": "hello"}]
SLOW_TOKENS = 100  # at 50 tokens a second: a stream of two seconds, to be cut mid-way


def provider(node: str) -> dict[str, object]:
    return {
        "id": f"{node}-pair",
        "type": "mock",
        "category": "local_inference",
        "models": [f"pair-{node[-1]}"],
        "capacity": 4,
        "max_queue": 16,
        "queue_timeout_ms": 20_000,
        "request_timeout_ms": 30_000,
        "tokens_per_second": 50,
    }


FLEET = {
    "models": [{"id": "pair", "providers": {f"{n}-pair": f"pair-{n[-1]}" for n in NODES}}],
    "nodes": [{"id": n, "providers": [provider(n)]} for n in NODES],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def edges(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[SimpleNamespace]:
    """The stack (control-plane, edge, two nodes, a worker) and a second edge, edge-b."""
    root = tmp_path_factory.mktemp("edges")
    async with start_stack_factory(root, FLEET) as stack:
        stack.second_edge_settings()
        second = await stack.start("edge-b")
        stack.pin_ports("edge-b")
        yield SimpleNamespace(
            stack=stack,
            api_a=stack.api_url,
            api_b=f"http://127.0.0.1:{second.ports['http']}/v1",
            node_port_b=second.ports["nodes"],
        )


async def metric(http: aiohttp.ClientSession, admin_url: str, name: str) -> float | None:
    """The sum of ``name``'s samples on a service's metrics page (``None``: none there)."""
    async with http.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    samples = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    ]
    return sum(samples) if samples else None


async def connected_nodes(http: aiohttp.ClientSession, api_url: str) -> set[str]:
    catalog = api_url.replace("/v1", "/iop/v1/catalog/providers")
    with contextlib.suppress(aiohttp.ClientError):
        async with http.get(catalog) as response:
            if response.status == 200:
                rows = (await response.json())["data"]
                return {row["node_id"] for row in rows if row["connected"]}
    return set()


async def linked_to_both(http: aiohttp.ClientSession, edges: SimpleNamespace) -> bool:
    """Each node and the worker registered with both edges, and each edge sees both nodes."""
    stack = edges.stack
    for peer, name in (*((n, "iop_node_edge_connected") for n in NODES), ("worker", None)):
        gauge = name or "iop_worker_edge_connected"
        if await metric(http, stack.services[peer].admin_url, gauge) != 2:
            return False
    for api in (edges.api_a, edges.api_b):
        if await connected_nodes(http, api) != set(NODES):
            return False
    return True


async def chat(http: aiohttp.ClientSession, api_url: str, text: str) -> dict[str, Any]:
    body = {"model": "pair", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    async with http.post(f"{api_url}/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


async def test_nodes_and_the_worker_given_one_edge_link_to_both(
    edges: SimpleNamespace, faults: SimpleNamespace
) -> None:
    async with aiohttp.ClientSession() as http:
        await faults.eventually(lambda: linked_to_both(http, edges), 30)
    # the settings name the first edge alone: the second was learnt from its list
    node = yaml.safe_load((edges.stack.root / "node-a.yaml").read_text())
    assert "edges" not in node
    assert node["edge"]["port"] == edges.stack.node_port


async def test_a_request_through_each_edge_completes(
    edges: SimpleNamespace, faults: SimpleNamespace
) -> None:
    async with aiohttp.ClientSession() as http:
        await faults.eventually(lambda: linked_to_both(http, edges), 30)
        for api in (edges.api_a, edges.api_b):
            answer = await chat(http, api, "hello")
            assert answer["choices"][0]["finish_reason"] in ("stop", "length")
            streamed = await faults.stream_chat(
                http, api, {"model": "pair", "messages": HELLO, "max_tokens": 4}, 30
            )
            assert streamed.kind == "completed", streamed


async def test_an_edge_lists_the_edges_only_to_a_peer_that_follows_them(
    edges: SimpleNamespace, faults: SimpleNamespace
) -> None:
    """A peer of an older version, which did not say ``follows_edges``, is sent no list."""
    stack = edges.stack
    async with aiohttp.ClientSession() as http:
        await faults.eventually(lambda: linked_to_both(http, edges), 30)
    for follows in (True, False):
        peer = "worker-evil"  # a worker identity of the stack's CA: no token needed
        reader, writer = await open_client(stack.node_port, client_context(stack.tls(peer)))
        async with Connection(reader, writer, sender_id=peer, heartbeat_interval=0) as conn:
            register = pb.RegisterRequest(
                peer_id=peer, role=pb.PEER_ROLE_WORKER, follows_edges=follows
            )
            await conn.send(register)
            answer = (await asyncio.wait_for(conn.receive(), 10)).register_response
        assert answer.accepted
        listed = {edge.edge_id: (edge.host, edge.port) for edge in answer.edges}
        if follows:
            assert listed == {
                "edge": ("127.0.0.1", stack.node_port),
                "edge-b": ("127.0.0.1", edges.node_port_b),
            }
        else:
            assert listed == {}


async def test_killing_one_edge_costs_only_its_requests_and_it_is_linked_again(
    edges: SimpleNamespace, faults: SimpleNamespace, report: Any
) -> None:
    """The figures print before the asserts, so that code without several edges (where
    the second edge never gets a node) prints its own (tools/hardening/several_edges.sh)."""
    stack = edges.stack
    slow = {
        "model": "pair",
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": SLOW_TOKENS,
        "iop_mock": {"fill": True},
    }

    async def through(api: str) -> Any:
        try:
            return await faults.stream_chat(http, api, slow, 60)
        except aiohttp.ClientError as exc:  # the edge died under the stream
            return faults.Outcome("error", 0, type(exc).__name__)

    async def answered(api: str, text: str) -> bool:
        body = {"model": "pair", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        with contextlib.suppress(aiohttp.ClientError):
            async with http.post(f"{api}/chat/completions", json=body) as response:
                return response.status == 200
        return False

    async def eventually(check: Any, timeout_s: float) -> bool:
        """Whether ``check`` came to hold in time (the asserts come after the figures)."""
        with contextlib.suppress(TimeoutError):
            await faults.eventually(check, timeout_s)
            return True
        return False

    async with aiohttp.ClientSession() as http:
        linked = await eventually(lambda: linked_to_both(http, edges), 30)
        via_a = [asyncio.create_task(through(edges.api_a)) for _ in range(3)]
        via_b = [asyncio.create_task(through(edges.api_b)) for _ in range(3)]

        async def carrying() -> bool:
            in_flight = 0.0
            for node in NODES:
                admin = stack.services[node].admin_url
                in_flight += await metric(http, admin, "iop_node_provider_in_flight") or 0
            return in_flight >= (6 if linked else 3)

        carried = await eventually(carrying, 30)
        await stack.stop("edge", signal.SIGKILL)

        # while the first edge is away, the second keeps serving
        during = [await answered(edges.api_b, f"during {i}") for i in range(5)]
        outcomes_b = await asyncio.gather(*via_b)
        outcomes_a = await asyncio.gather(*via_a)
        completed_b = sum(o.kind == "completed" for o in outcomes_b) + sum(during)
        report(
            f"through edge-b: {len(outcomes_b) + len(during)} sent, {completed_b} completed"
            f" (3 in flight as edge-a died, 5 after); through the killed edge-a:"
            f" {len(outcomes_a)} in flight, {sum(o.kind == 'completed' for o in outcomes_a)}"
            " completed"
        )
        assert linked
        assert carried
        assert [o.kind for o in outcomes_b] == ["completed"] * 3, outcomes_b
        assert during == [True] * 5
        assert all(o.kind != "completed" for o in outcomes_a), outcomes_a  # lost with it

        await stack.start("edge")  # the same ports: the nodes' seeds
        await faults.eventually(lambda: linked_to_both(http, edges), 30)
        answer = await chat(http, edges.api_a, "back")
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
