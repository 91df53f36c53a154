"""The ownership rule with a real dispatcher, fake connections and fake leases."""

from __future__ import annotations

from collections.abc import Iterable, Set

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.peer_guard import NotYours, PeerGuard
from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_proto.connection import Connection
from iop_proto.v1 import runtime_pb2 as pb


class FakeConn:
    peer = None
    peer_name = "127.0.0.1:1"


class FakeNode:
    """A node connection: ``NodeLink`` for dispatch, ``NodePeer`` for the guard."""

    def __init__(self, node_id: str, configured: Set[str] = frozenset()) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.conn: Connection = FakeConn()  # type: ignore[assignment]
        self.configured = configured

    async def send_run(self, request: RunOrder) -> None:
        pass

    async def send_cancel(self, run_id: str, reason: str) -> None:
        pass


class FakeWorker:
    def __init__(self, worker_id: str, leases: Iterable[str] = ()) -> None:
        self.worker_id = worker_id
        self.conn: Connection = FakeConn()  # type: ignore[assignment]
        self.leases = frozenset(leases)


class Leases:
    """``BatchLeases.lease_holder`` over a dict (the rest is not the guard's business)."""

    def __init__(self, holders: dict[str, str]) -> None:
        self.holders = holders

    async def lease_holder(self, lease_id: str) -> str | None:
        return self.holders.get(lease_id)


def provider(pid: str, node: str) -> ProviderEntry:
    return ProviderEntry(pid, node, "mock", "local_inference", (pid,), 2, 0, 100, 30_000)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> EdgeMetrics:
    return EdgeMetrics.create(registry)


@pytest.fixture
def dispatcher(metrics: EdgeMetrics) -> Dispatch:
    d = Dispatch(metrics)
    providers = {"a": provider("a", "node-a"), "b": provider("b", "node-b")}
    d.pool.apply_fleet(Fleet(1, {"m": ModelEntry("m", "M", {"a": "m-a"})}, providers))
    return d


@pytest.fixture
def rules(dispatcher: Dispatch, metrics: EdgeMetrics) -> PeerGuard:
    return PeerGuard(dispatcher, dispatcher.pool, metrics, Leases({"lease_1": "worker"}))  # type: ignore[arg-type]


def refused(registry: CollectorRegistry, role: str, reason: str) -> float:
    labels = {"stage": "ownership", "role": role, "reason": reason}
    return registry.get_sample_value("iop_edge_peer_refusals_total", labels) or 0.0


async def test_a_run_takes_events_only_from_the_connection_it_was_dispatched_on(
    dispatcher: Dispatch, rules: PeerGuard, registry: CollectorRegistry
) -> None:
    owner, again, other = FakeNode("node-a"), FakeNode("node-a"), FakeNode("node-fuzz")
    state = pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)
    dispatcher.pool.node_connected(owner, provider_reports([state]))
    spec = RunSpec("m", Operation.CHAT_COMPLETIONS, {"messages": []}, True, False)
    run = await dispatcher.open_run(spec)
    event = pb.RunEvent(run_id=run.run_id, delta=pb.RunDelta(text="x"))

    rules.run_event(owner, event)  # its own: passes
    rules.run_event(other, pb.RunEvent(run_id="ended-here-already"))  # unknown: passes
    for stranger in (other, again):  # another node, or the same node on another connection
        with pytest.raises(NotYours) as caught:
            rules.run_event(stranger, event)
        assert caught.value.code == pb.ERROR_CODE_PERMISSION_DENIED
    assert refused(registry, "node", "foreign_run") == 2
    assert not run.attempt_finished


def test_a_snapshot_speaks_only_of_the_senders_providers(
    dispatcher: Dispatch, rules: PeerGuard, registry: CollectorRegistry
) -> None:
    fuzz = FakeNode("node-fuzz")
    states = [pb.ProviderState(provider_id=p) for p in ("ghost", "a")]
    rules.snapshot(FakeNode("node-a"), pb.ProviderSnapshot(node_id="node-a", providers=states))
    rules.snapshot(fuzz, pb.ProviderSnapshot(providers=states[:1]))  # outside the fleet
    # configured with "b" before a fleet change gave it to node-b: a stale report, ignored
    rules.provider_states(FakeNode("node-a", {"b"}), [pb.ProviderState(provider_id="b")])
    with pytest.raises(NotYours):
        rules.snapshot(fuzz, pb.ProviderSnapshot(node_id="node-fuzz", providers=states))
    with pytest.raises(NotYours):
        rules.snapshot(fuzz, pb.ProviderSnapshot(node_id="node-a"))
    assert refused(registry, "node", "foreign_provider") == 1
    assert refused(registry, "node", "foreign_node") == 1


async def test_a_worker_acts_only_on_its_own_leases(
    dispatcher: Dispatch, rules: PeerGuard, registry: CollectorRegistry
) -> None:
    await rules.lease(FakeWorker("worker", ["lease_1"]), "lease_1", "renew")
    await rules.lease(FakeWorker("worker-evil"), "lease_expired_and_taken", "renew")
    rules.lease_request(FakeWorker("worker-evil"), pb.LeaseRequest(worker_id="worker-evil"))
    with pytest.raises(NotYours):
        await rules.lease(FakeWorker("worker-evil"), "lease_1", "release")
    with pytest.raises(NotYours):
        rules.lease_request(FakeWorker("worker-evil"), pb.LeaseRequest(worker_id="worker"))
    assert refused(registry, "worker", "foreign_lease") == 1
    assert refused(registry, "worker", "foreign_worker") == 1


async def test_a_second_connection_of_a_worker_has_no_business_with_the_firsts_leases(
    rules: PeerGuard, registry: CollectorRegistry
) -> None:
    first, second = FakeWorker("worker", ["lease_1"]), FakeWorker("worker")
    await rules.lease(first, "lease_1", "renew")
    for action in ("renew", "release", "run line 3 under"):
        with pytest.raises(NotYours):
            await rules.lease(second, "lease_1", action)
    assert refused(registry, "worker", "foreign_session") == 3
    assert refused(registry, "worker", "foreign_lease") == 0


async def test_a_replaced_connections_runs_end_with_it(dispatcher: Dispatch) -> None:
    old, new = FakeNode("node-a"), FakeNode("node-a")
    state = pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)
    dispatcher.pool.node_connected(old, provider_reports([state]))
    spec = RunSpec("m", Operation.CHAT_COMPLETIONS, {"messages": []}, True, False)
    run = await dispatcher.open_run(spec)
    dispatcher.pool.node_connected(new, provider_reports([state]))  # the node registered again
    dispatcher.pool.node_disconnected(old, "replaced by a new connection")
    # nothing else would end it: the node cancelled it with the old link
    assert run.attempt_finished
    assert dispatcher.pool.slot("a").connected
    assert dispatcher.pool.slot("a").own_in_flight == 0
