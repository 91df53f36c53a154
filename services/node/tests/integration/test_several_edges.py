"""One node, two test edges over real mTLS: the node dials every edge listed, each link
is its own (its runs, its loss), and the provider's one FIFO orders the runs of both."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme
from prometheus_client import CollectorRegistry

from iop_node.bootstrap import build
from iop_node.settings import NodeSettings
from iop_proto.connection import Connection
from iop_proto.errors import ConnectionClosed
from iop_proto.service import AdminServer
from iop_proto.testing import loopback_server, write_identity
from iop_proto.tls import TlsSettings, server_context
from iop_proto.v1 import runtime_pb2 as pb

TOKEN = "iopnt_test-token"
FILL = {"fill": True}  # the mock answers max_tokens tokens: a run that lasts
TOKENS_PER_SECOND = 20  # one token every 50 ms: 20 tokens are a run of a second


def provider(capacity: int = 2, max_queue: int = 4) -> pb.ProviderConfig:
    return pb.ProviderConfig(
        id="node-a-mock",
        type="mock",
        category=pb.PROVIDER_CATEGORY_LOCAL_INFERENCE,
        models=["mock-small"],
        capacity=capacity,
        max_queue=max_queue,
        queue_timeout_ms=30_000,
        request_timeout_ms=60_000,
        settings_json=json.dumps(
            {"tokens_per_second": TOKENS_PER_SECOND, "default_tokens": 2}
        ).encode(),
    )


@dataclass
class Session:
    """One registered node connection, seen from one test edge."""

    edge: ListingEdge
    conn: Connection
    register: pb.RegisterRequest
    events: dict[str, list[pb.RunEvent]] = field(default_factory=dict)
    snapshots: list[pb.ProviderSnapshot] = field(default_factory=list)
    seen: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def pump(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for envelope in self.conn:
                async with self.seen:
                    kind = envelope.WhichOneof("body")
                    if kind == "provider_snapshot":
                        self.snapshots.append(envelope.provider_snapshot)
                    elif kind == "run_event":
                        event = envelope.run_event
                        self.events.setdefault(event.run_id, []).append(event)
                        if event.WhichOneof("kind") in ("complete", "error"):
                            self.edge.ends.append(event.run_id)
                    self.seen.notify_all()

    async def until(self, check: Callable[[], bool]) -> None:
        async with asyncio.timeout(15), self.seen:
            await self.seen.wait_for(check)

    async def run(self, run_id: str, tokens: int, *, model_fill: bool = True) -> None:
        body = {"model": "mock-small", "messages": [], "max_tokens": tokens}
        if model_fill:
            body["iop_mock"] = FILL
        request = pb.RunRequest(
            run_id=run_id,
            model="mock-small",
            provider_id="node-a-mock",
            adapter="mock",
            target="mock-small",
            operation=pb.OPERATION_CHAT_COMPLETIONS,
            body_json=json.dumps(body).encode(),
            stream=True,
        )
        await self.conn.send(request, correlation_id=run_id)

    def kinds(self, run_id: str) -> list[str]:
        return [str(e.WhichOneof("kind")) for e in self.events.get(run_id, [])]

    async def ended(self, run_id: str) -> str:
        """How the run ended: ``complete`` or ``error``."""
        await self.until(lambda: bool({"complete", "error"} & set(self.kinds(run_id))))
        return self.kinds(run_id)[-1]


class ListingEdge:
    """The edge's side of a node registration, with the list of edges the real edge
    passes on from the control-plane (``RegisterResponse.edges``)."""

    def __init__(self, edge_id: str, ends: list[str], capacity: int = 2) -> None:
        self.edge_id = edge_id
        self.ends = ends  # run ids as their terminal events arrive, at any edge
        self.capacity = capacity
        self.edges: list[pb.EdgeEndpoint] = []
        self.port = 0
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()
        self.registrations = 0

    @property
    def endpoint(self) -> pb.EdgeEndpoint:
        return pb.EdgeEndpoint(
            edge_id=self.edge_id, host="127.0.0.1", port=self.port, server_name="localhost"
        )

    def config(self, register: pb.RegisterRequest) -> pb.NodeConfig:
        return pb.NodeConfig(node_id=register.peer_id, providers=[provider(self.capacity)])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id=self.edge_id, heartbeat_interval=0) as conn:
            hello = await conn.receive()
            register = hello.register_request
            assert register.token == TOKEN
            self.registrations += 1
            await conn.send(
                pb.RegisterResponse(
                    accepted=True,
                    node_config=self.config(register),
                    heartbeat_interval_ms=30_000,
                    edge_id=self.edge_id,
                    takes_folded_completions=True,
                    takes_provider_load=True,  # as the real edge: no snapshot per run
                    edges=self.edges if register.follows_edges else [],
                ),
                correlation_id=hello.message_id,
            )
            session = Session(self, conn, register)
            await self.sessions.put(session)
            await session.pump()

    async def list_edges(self, session: Session, edges: list[pb.EdgeEndpoint]) -> None:
        """Push a new list, the way the real edge pushes a changed one."""
        self.edges = edges
        update = pb.RegisterResponse(
            accepted=True, node_config=self.config(session.register), edge_id=self.edge_id
        )
        update.edges.extend(edges)
        await session.conn.send(update)


@dataclass
class Pki:
    edge: TlsSettings
    node: TlsSettings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = trustme.CA()
    directory = tmp_path_factory.mktemp("pki")
    return Pki(
        edge=write_identity(ca, directory, "edge", "edge"),
        node=write_identity(ca, directory, "node-a", "node"),
    )


@dataclass
class Fleet:
    a: ListingEdge
    b: ListingEdge
    ends: list[str]


@contextlib.asynccontextmanager
async def two_edges(pki: Pki, capacity: int = 2) -> AsyncIterator[Fleet]:
    """Edges ``edge-a`` and ``edge-b``, each listing both."""
    ends: list[str] = []
    a, b = ListingEdge("edge-a", ends, capacity), ListingEdge("edge-b", ends, capacity)
    context = server_context(pki.edge)
    async with loopback_server(a.handle, context) as a.port:
        async with loopback_server(b.handle, context) as b.port:
            a.edges = b.edges = [a.endpoint, b.endpoint]
            yield Fleet(a, b, ends)


@contextlib.asynccontextmanager
async def running_node(
    pki: Pki, tmp_path: Path, edges: list[int], **more: object
) -> AsyncIterator[CollectorRegistry]:
    """A real node whose settings name the edges on ``edges`` (ports), and no other: one
    as ``edge``, more as ``edges``."""
    addresses = [{"host": "127.0.0.1", "port": port, "server_name": "localhost"} for port in edges]
    seeds = {"edge": addresses[0]} if len(addresses) == 1 else {"edges": addresses}
    settings = NodeSettings.model_validate(
        {
            "service_id": "node-a",
            "tls": pki.node.model_dump(),
            **seeds,
            "token": TOKEN,
            "history_db": str(tmp_path / "history.db"),
            "probes": {"interval_s": 0.1},
            "reconnect": {"initial_s": 0.05, "max_s": 0.2},
            "snapshot_interval_s": 3600,  # snapshots only for a change: none by the clock
            **more,
        }
    )
    registry = CollectorRegistry()
    admin = AdminServer("node", registry, host="127.0.0.1", port=0)
    async with build(settings, registry, admin):
        yield registry


async def next_session(edge: ListingEdge) -> Session:
    return await asyncio.wait_for(edge.sessions.get(), 15)


def links_up(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("iop_node_edge_connected")


async def test_a_node_given_one_edge_links_to_every_edge_listed(pki: Pki, tmp_path: Path) -> None:
    async with two_edges(pki) as fleet, running_node(pki, tmp_path, [fleet.a.port]) as metrics:
        at_a = await next_session(fleet.a)
        assert at_a.register.follows_edges
        at_b = await next_session(fleet.b)  # learnt from edge-a's list
        assert at_b.register.peer_id == "node-a"
        await at_b.until(lambda: links_up(metrics) == 2)
        assert fleet.a.registrations == 1  # the seed is edge-a: listed, it is not dialled twice

        # every edge sees the node's providers, and a run through each completes
        for session in (at_a, at_b):
            await session.until(lambda: bool(session.snapshots))  # noqa: B023 - awaited here
            [state] = session.snapshots[-1].providers
            assert state.provider_id == "node-a-mock"
        await at_a.run("via-a", 2)
        await at_b.run("via-b", 2)
        assert await at_a.ended("via-a") == "complete"
        assert await at_b.ended("via-b") == "complete"


async def test_losing_one_edge_costs_only_its_runs_and_it_is_dialled_again(
    pki: Pki, tmp_path: Path
) -> None:
    async with two_edges(pki) as fleet, running_node(pki, tmp_path, [fleet.a.port]):
        at_a = await next_session(fleet.a)
        at_b = await next_session(fleet.b)
        await at_a.run("carried-by-a", TOKENS_PER_SECOND)  # about a second
        await at_b.run("carried-by-b", 1000)
        await at_b.until(lambda: "delta" in at_b.kinds("carried-by-b"))
        await at_b.conn.close()  # edge-b goes: its run is lost with it

        assert await at_a.ended("carried-by-a") == "complete"  # edge-a's run is not touched
        again = await next_session(fleet.b)  # still listed: dialled again
        await again.run("after", 2)
        assert await again.ended("after") == "complete"
        # the lost run was cancelled at the provider: both slots are free again
        await again.run("one", TOKENS_PER_SECOND)
        await at_a.run("two", TOKENS_PER_SECOND)
        assert await again.ended("one") == "complete"
        assert await at_a.ended("two") == "complete"


async def test_an_edge_no_longer_listed_keeps_its_connection_but_is_not_dialled_again(
    pki: Pki, tmp_path: Path
) -> None:
    async with two_edges(pki) as fleet, running_node(pki, tmp_path, [fleet.a.port]) as metrics:
        at_a = await next_session(fleet.a)
        at_b = await next_session(fleet.b)
        await at_b.until(lambda: links_up(metrics) == 2)
        await fleet.a.list_edges(at_a, [fleet.a.endpoint])  # edge-b left the list
        # Its connection proves it alive: it stays, and serves, until it ends.
        await at_b.run("still-served", 2)
        assert await at_b.ended("still-served") == "complete"
        await at_b.conn.close()
        await at_a.until(lambda: links_up(metrics) == 1)
        # Not dialled again: five times the longest backoff (0.2 s) pass without a dial.
        await asyncio.sleep(1.0)
        assert fleet.b.sessions.empty()
        assert fleet.b.registrations == 1

        await fleet.a.list_edges(at_a, [fleet.a.endpoint, fleet.b.endpoint])  # listed again
        back = await next_session(fleet.b)
        await back.run("back", 2)
        assert await back.ended("back") == "complete"


async def test_the_providers_fifo_is_the_order_across_edges(pki: Pki, tmp_path: Path) -> None:
    """Capacity 1, the provider busy: a run queued at the node from edge-a before one
    from edge-b starts (and ends) first; and edge-b, which sent nothing yet, hears of
    edge-a's run taking the slot (a snapshot), so its own selection sees it busy."""
    async with (
        two_edges(pki, capacity=1) as fleet,
        running_node(pki, tmp_path, [fleet.a.port, fleet.b.port]),
    ):
        at_a = await next_session(fleet.a)
        at_b = await next_session(fleet.b)
        await at_b.until(lambda: bool(at_b.snapshots))
        busy_from = len(at_b.snapshots)

        await at_a.run("busy", 2 * TOKENS_PER_SECOND)  # the slot, for two seconds
        await at_a.until(lambda: "delta" in at_a.kinds("busy"))
        await at_b.until(
            lambda: any(s.providers[0].in_flight == 1 for s in at_b.snapshots[busy_from:])
        )
        await at_a.run("first", TOKENS_PER_SECOND)
        await at_a.until(lambda: "accepted" in at_a.kinds("first"))  # queued at the node
        await at_b.run("second", TOKENS_PER_SECOND)
        await at_b.until(lambda: "accepted" in at_b.kinds("second"))

        for session, run_id in ((at_a, "busy"), (at_a, "first"), (at_b, "second")):
            assert await session.ended(run_id) == "complete"
        assert fleet.ends == ["busy", "first", "second"]
        started = {
            run_id: next(e for e in session.events[run_id] if e.WhichOneof("kind") == "start")
            for session, run_id in ((at_a, "first"), (at_b, "second"))
        }
        # both waited in the node's queue, the later one longer
        assert 0 < started["first"].start.queue_wait_ms < started["second"].start.queue_wait_ms
