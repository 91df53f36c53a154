"""The node against a test edge over real mTLS: register, snapshot, run, cancel, reconnect."""

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


def mock_provider(
    provider_id: str = "node-a-mock", tokens_per_second: float = 0
) -> pb.ProviderConfig:
    return pb.ProviderConfig(
        id=provider_id,
        type="mock",
        category=pb.PROVIDER_CATEGORY_LOCAL_INFERENCE,
        models=["mock-small"],
        capacity=2,
        max_queue=4,
        queue_timeout_ms=5000,
        request_timeout_ms=30_000,
        settings_json=json.dumps(
            {"tokens_per_second": tokens_per_second, "default_tokens": 8}
        ).encode(),
    )


@dataclass
class NodeSession:
    """One registered node connection, seen from the edge."""

    conn: Connection
    register: pb.RegisterRequest
    inbox: asyncio.Queue[pb.Envelope] = field(default_factory=asyncio.Queue)
    snapshots: list[pb.ProviderSnapshot] = field(default_factory=list)
    snapshot_seen: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def pump(self) -> None:
        try:
            async for envelope in self.conn:
                if envelope.WhichOneof("body") == "provider_snapshot":
                    async with self.snapshot_seen:
                        self.snapshots.append(envelope.provider_snapshot)
                        self.snapshot_seen.notify_all()
                else:
                    await self.inbox.put(envelope)
        except ConnectionClosed:
            pass

    async def wait_for_snapshot(
        self, check: Callable[[pb.ProviderState], bool], since: int = 0
    ) -> pb.ProviderSnapshot:
        """The first snapshot (from the ``since``-th on) whose providers all pass ``check``."""
        async with asyncio.timeout(10), self.snapshot_seen:
            while True:
                for snapshot in self.snapshots[since:]:
                    if snapshot.providers and all(check(p) for p in snapshot.providers):
                        return snapshot
                await self.snapshot_seen.wait()

    async def run(self, run_id: str, body: dict[str, object], stream: bool) -> None:
        request = pb.RunRequest(
            run_id=run_id,
            model="mock-small",
            provider_id="node-a-mock",
            adapter="mock",
            target="mock-small",
            operation=pb.OPERATION_CHAT_COMPLETIONS,
            body_json=json.dumps({"model": "mock-small", **body}).encode(),
            stream=stream,
        )
        await self.conn.send(request, correlation_id=run_id)

    async def events(self, run_id: str) -> list[pb.RunEvent]:
        """Events of one run up to its terminal event."""
        events: list[pb.RunEvent] = []
        async with asyncio.timeout(10):
            while True:
                envelope = await self.inbox.get()
                assert envelope.WhichOneof("body") == "run_event", envelope
                assert envelope.run_event.run_id == run_id
                events.append(envelope.run_event)
                if envelope.run_event.WhichOneof("kind") in ("complete", "error"):
                    return events


class FakeEdge:
    """The edge's side of node registration, just enough to drive a real node."""

    def __init__(
        self, providers: list[pb.ProviderConfig], *, folds: bool = False, loads: bool = False
    ) -> None:
        self.providers = providers
        self.folds = folds  # the edge takes folded completions (as the real edge does)
        self.loads = loads  # the edge reads a run's end's load (as the real edge does)
        self.sessions: asyncio.Queue[NodeSession] = asyncio.Queue()
        self._pumps: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with Connection(reader, writer, sender_id="edge", heartbeat_interval=0) as conn:
            hello = await conn.receive()
            register = hello.register_request
            accepted = register.token == TOKEN and conn.peer is not None
            accepted = accepted and conn.peer.name == register.peer_id
            await conn.send(
                pb.RegisterResponse(
                    accepted=accepted,
                    reason="" if accepted else "bad token",
                    node_config=pb.NodeConfig(node_id=register.peer_id, providers=self.providers),
                    heartbeat_interval_ms=30_000,
                    edge_id="test-edge",
                    takes_folded_completions=self.folds,
                    takes_provider_load=self.loads,
                ),
                correlation_id=hello.message_id,
            )
            if not accepted:
                return
            session = NodeSession(conn, register)
            await self.sessions.put(session)
            await session.pump()


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


@contextlib.asynccontextmanager
async def running_node(pki: Pki, port: int, tmp_path: Path, **more: object) -> AsyncIterator[None]:
    settings = NodeSettings.model_validate(
        {
            **more,
            "service_id": "node-a",
            "tls": pki.node.model_dump(),
            "edge": {"host": "127.0.0.1", "port": port, "server_name": "localhost"},
            "token": TOKEN,
            "history_db": str(tmp_path / "history.db"),
            "probes": {"interval_s": 0.1},
            "reconnect": {"initial_s": 0.05, "max_s": 0.2},
        }
    )
    registry = CollectorRegistry()
    admin = AdminServer("node", registry, host="127.0.0.1", port=0)
    async with build(settings, registry, admin):
        yield


@pytest.fixture
async def edge_and_node(pki: Pki, tmp_path: Path) -> AsyncIterator[FakeEdge]:
    edge = FakeEdge([mock_provider(tokens_per_second=0)])
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path):
            yield edge


async def test_registers_reports_available_and_streams_a_run(edge_and_node: FakeEdge) -> None:
    session = await asyncio.wait_for(edge_and_node.sessions.get(), 10)
    assert session.register.peer_id == "node-a"
    assert session.register.role == pb.PEER_ROLE_NODE
    assert session.register.acknowledges_runs  # the edge may time its acknowledgements

    snapshot = await session.wait_for_snapshot(lambda p: p.health == pb.HEALTH_AVAILABLE)
    [state] = snapshot.providers
    assert (state.provider_id, state.capacity, state.in_flight, state.queued) == (
        "node-a-mock",
        2,
        0,
        0,
    )
    assert list(state.models) == ["mock-small"]
    assert state.capabilities.list_models

    await session.run(
        "run-1", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, stream=True
    )
    events = await session.events("run-1")
    assert [e.sequence for e in events] == list(range(len(events)))
    kinds = [e.WhichOneof("kind") for e in events]
    assert kinds[:2] == ["accepted", "start"]  # taken, then begun on its provider
    assert kinds[-1] == "complete"
    assert kinds.count("delta") == 5
    assert events[-1].complete.usage.completion_tokens == 5
    assert events[1].start.provider_id == "node-a-mock"


async def test_non_streaming_run_returns_the_whole_result(edge_and_node: FakeEdge) -> None:
    session = await asyncio.wait_for(edge_and_node.sessions.get(), 10)
    await session.run(
        "run-2", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, stream=False
    )
    events = await session.events("run-2")
    # an edge that did not say it takes folded completions gets all three events
    assert [e.WhichOneof("kind") for e in events] == ["accepted", "start", "complete"]
    result = json.loads(events[-1].complete.result_json)
    assert result["object"] == "chat.completion"
    assert result["usage"]["completion_tokens"] == 3


@contextlib.asynccontextmanager
async def folding_session(
    tokens_per_second: float, pki: Pki, tmp_path: Path
) -> AsyncIterator[NodeSession]:
    """A real node registered with a test edge that takes folded completions."""
    edge = FakeEdge([mock_provider(tokens_per_second=tokens_per_second)], folds=True)
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path):
            yield await asyncio.wait_for(edge.sessions.get(), 10)


THREE_TOKENS = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_a_fast_run_sends_its_completion_alone_to_an_edge_that_takes_folds(
    pki: Pki, tmp_path: Path
) -> None:
    async with folding_session(0, pki, tmp_path) as session:
        await session.run("fast", THREE_TOKENS, stream=False)
        [event] = await session.events("fast")  # acknowledges, starts and ends the run
        assert (event.sequence, event.WhichOneof("kind")) == (0, "complete")
        start = event.complete.start
        assert (start.provider_id, start.target) == ("node-a-mock", "mock-small")
        assert json.loads(event.complete.result_json)["usage"]["completion_tokens"] == 3
        # a stream's first delta leaves with the acknowledgement and the start, unfolded
        await session.run("streamed", THREE_TOKENS, stream=True)
        events = await session.events("streamed")
        assert [e.sequence for e in events] == list(range(len(events)))
        assert [e.WhichOneof("kind") for e in events[:2]] == ["accepted", "start"]
        assert not events[-1].complete.HasField("start")


async def test_a_run_past_the_hold_is_acknowledged_alone_even_when_the_edge_takes_folds(
    pki: Pki, tmp_path: Path
) -> None:
    async with folding_session(50, pki, tmp_path) as session:  # 3 tokens: ~60 ms > 20 ms
        await session.run("slow", THREE_TOKENS, stream=False)
        events = await session.events("slow")
        assert [(e.sequence, e.WhichOneof("kind")) for e in events] == [
            (0, "accepted"),
            (1, "start"),
            (2, "complete"),
        ]
        assert not events[-1].complete.HasField("start")


async def test_cancel_frees_the_slot(pki: Pki, tmp_path: Path) -> None:
    edge = FakeEdge([mock_provider(tokens_per_second=20)])
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path):
            session = await asyncio.wait_for(edge.sessions.get(), 10)
            await session.run(
                "slow", {"messages": [], "max_tokens": 1000, "iop_mock": FILL}, stream=True
            )
            first = await asyncio.wait_for(session.inbox.get(), 10)
            assert first.run_event.WhichOneof("kind") == "accepted"
            await session.wait_for_snapshot(lambda p: p.in_flight == 1)
            # Snapshots from here on: the one the freed slot sends may come before the
            # error event is read (clearing the list then lost it, until the periodic one).
            since = len(session.snapshots)
            await session.conn.send(pb.CancelRequest(run_id="slow", reason="client gone"))
            while True:
                envelope = await asyncio.wait_for(session.inbox.get(), 10)
                if envelope.run_event.WhichOneof("kind") == "error":
                    break
            assert envelope.run_event.error.code == pb.ERROR_CODE_CANCELLED
            await session.wait_for_snapshot(lambda p: p.in_flight == 0 and p.queued == 0, since)


async def test_reconnects_after_the_edge_drops_and_cancels_the_lost_runs(
    pki: Pki, tmp_path: Path
) -> None:
    edge = FakeEdge([mock_provider(tokens_per_second=20)])
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path):
            first = await asyncio.wait_for(edge.sessions.get(), 10)
            await first.run(
                "lost", {"messages": [], "max_tokens": 1000, "iop_mock": FILL}, stream=True
            )
            await first.wait_for_snapshot(lambda p: p.in_flight == 1)
            await first.conn.close()  # the edge drops the node

            second = await asyncio.wait_for(edge.sessions.get(), 10)
            assert second.register.peer_id == "node-a"
            # the run of the lost connection was cancelled at the provider: its slot is free
            await second.wait_for_snapshot(lambda p: p.in_flight == 0)
            await second.run("after", {"messages": [], "max_tokens": 2}, stream=True)
            events = await second.events("after")
            assert events[-1].WhichOneof("kind") == "complete"


async def test_unknown_provider_fails_the_run_not_the_link(edge_and_node: FakeEdge) -> None:
    session = await asyncio.wait_for(edge_and_node.sessions.get(), 10)
    request = pb.RunRequest(
        run_id="bad",
        provider_id="nope",
        target="x",
        operation=pb.OPERATION_CHAT_COMPLETIONS,
        body_json=b"{}",
    )
    await session.conn.send(request)
    events = await session.events("bad")
    assert events[-1].error.code == pb.ERROR_CODE_NOT_FOUND
    await session.run("ok", {"messages": [], "max_tokens": 1}, stream=True)
    assert (await session.events("ok"))[-1].WhichOneof("kind") == "complete"


async def test_a_completion_too_large_for_a_frame_fails_its_run_not_the_link(
    pki: Pki, tmp_path: Path
) -> None:
    """The mock does not bound its answer (no engine sends it one): the frame's own check
    refuses it before a byte is written, the run fails alone with the next number, and
    the link carries the next run (issue 29: it once failed as an internal error)."""
    wordy = mock_provider()
    wordy.settings_json = json.dumps({"tokens_per_second": 0, "default_tokens": 40_000}).encode()
    edge = FakeEdge([wordy])
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path, max_frame_size=128 * 1024):
            session = await asyncio.wait_for(edge.sessions.get(), 10)
            await session.run("wordy", {"messages": [{"role": "user", "content": "hi"}]}, False)
            events = await session.events("wordy")
            assert [e.sequence for e in events] == list(range(len(events)))
            error = events[-1].error
            assert error.code == pb.ERROR_CODE_INVALID_REQUEST
            assert error.message.startswith("The answer is too large")
            await session.run("short", {"messages": [], "max_tokens": 2}, stream=False)
            assert (await session.events("short"))[-1].WhichOneof("kind") == "complete"


async def test_an_edge_that_reads_loads_gets_them_on_each_runs_end_and_no_snapshot(
    pki: Pki, tmp_path: Path
) -> None:
    """To an edge that takes ``ProviderLoad`` the run's end carries its provider's load
    (its slot free again) and cache account (its prompt in it); a run's start and end
    send no snapshot: the next snapshot is the one a config change asks for."""
    edge = FakeEdge([mock_provider(tokens_per_second=0)], loads=True)
    prompt = [{"role": "user", "content": "a question long enough for blocks " * 24}]

    async def configure(session: NodeSession, capacity: int) -> None:
        provider = mock_provider(tokens_per_second=0)
        provider.capacity = capacity
        config = pb.NodeConfig(node_id="node-a", providers=[provider])
        await session.conn.send(pb.RegisterResponse(accepted=True, node_config=config))
        await session.wait_for_snapshot(lambda p: p.capacity == capacity)

    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path, snapshot_interval_s=3600):
            session = await asyncio.wait_for(edge.sessions.get(), 10)
            await session.wait_for_snapshot(lambda p: p.health == pb.HEALTH_AVAILABLE)
            await configure(session, 3)  # the registration's snapshots are all in
            since = len(session.snapshots)
            tails: set[int] = set()
            for number in range(3):
                run_id = f"r{number}"
                await session.run(run_id, {"messages": prompt, "max_tokens": 2}, stream=True)
                end = (await session.events(run_id))[-1]
                assert end.WhichOneof("kind") == "complete"
                load = end.complete.load
                assert (load.in_flight, load.queued) == (0, 0)
                [prefix] = load.cache.prefixes  # one conversation: one place, its newest
                assert prefix.blocks >= 2
                tails.add(prefix.tail)
            assert len(tails) == 1  # the same prompt each time: the same cached prefix

            await configure(session, 4)
            assert [s.providers[0].capacity for s in session.snapshots[since:]] == [4]


async def test_a_drained_provider_hands_its_queued_runs_back_and_its_running_one_finishes(
    pki: Pki, tmp_path: Path
) -> None:
    """Runtime control (docs/ARCHITECTURE.md#runtime-control): a config that says
    ``draining`` hands the runs waiting in the provider's FIFO back at once, retriable
    (``provider_unavailable``, before their first byte: the edge fails them over),
    refuses new ones the same way, and lets the run under way finish; the provider is
    not marked unavailable for it."""
    provider = mock_provider(tokens_per_second=20)
    provider.capacity = 1
    edge = FakeEdge([provider])
    hello = {"messages": [{"role": "user", "content": "hi"}], "iop_mock": FILL}
    async with loopback_server(edge.handle, server_context(pki.edge)) as port:
        async with running_node(pki, port, tmp_path):
            session = await asyncio.wait_for(edge.sessions.get(), 10)
            await session.wait_for_snapshot(lambda p: p.health == pb.HEALTH_AVAILABLE)
            await session.run("long", {**hello, "max_tokens": 40}, stream=True)  # 2 s
            for run_id in ("queued-1", "queued-2"):
                await session.run(run_id, {**hello, "max_tokens": 2}, stream=False)
            await session.wait_for_snapshot(lambda p: p.queued == 2)
            held = pb.ProviderConfig()
            held.CopyFrom(provider)
            held.control_state = "draining"
            config = pb.NodeConfig(node_id="node-a", providers=[held])
            await session.conn.send(pb.RegisterResponse(accepted=True, node_config=config))
            await session.run("new", {**hello, "max_tokens": 2}, stream=False)
            ends: dict[str, pb.RunEvent] = {}
            started: set[str] = set()
            async with asyncio.timeout(20):
                while len(ends) < 4:
                    event = (await session.inbox.get()).run_event
                    kind = event.WhichOneof("kind")
                    if kind in ("complete", "error"):
                        ends[event.run_id] = event
                    elif kind == "start":
                        started.add(event.run_id)
            assert ends["long"].WhichOneof("kind") == "complete"
            for run_id in ("queued-1", "queued-2", "new"):
                assert ends[run_id].WhichOneof("kind") == "error", ends[run_id]
                assert ends[run_id].error.code == pb.ERROR_CODE_PROVIDER_UNAVAILABLE
                assert "draining by an operator" in ends[run_id].error.message
            assert started == {"long"}  # nothing but the long run reached the provider
            snapshot = await session.wait_for_snapshot(lambda p: p.in_flight == 0)
            assert snapshot.providers[0].health == pb.HEALTH_AVAILABLE
