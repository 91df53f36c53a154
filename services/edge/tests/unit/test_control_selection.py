"""Runtime control in edge selection: a model's preference (the first listed provider with
a free slot wins, then the next, the unlisted last by the normal rule), and a disabled or
draining provider pushed with no capacity, out of selection
(docs/ARCHITECTURE.md#runtime-control)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.controls import preference_tiers
from iop_edge.domain.events import Completed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.pool import AVAILABLE, ModelIndex, ProviderSlot, index_models
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import RecordingNodeLink, WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb


def slot(name: str, in_flight: int = 0, capacity: int = 4) -> ProviderSlot:
    s = ProviderSlot(name, "node", capacity=capacity, health=AVAILABLE, connected=True)
    s.own_in_flight = in_flight
    return s


def test_preference_tiers_put_the_unlisted_last() -> None:
    assert preference_tiers(["a", "b", "c"], ["c", "a"]) == (1, 2, 0)
    assert preference_tiers(["a", "b"], []) == (0, 0)


def test_the_first_preferred_provider_with_a_free_slot_wins_over_a_lower_load() -> None:
    a, b, c = slot("a"), slot("b", 3), slot("c", 2)
    index = ModelIndex("m", [a, b, c], ["b", "c"])
    assert index.select() is b  # 3/4 loaded, but listed first
    b.take()  # full now: the next listed
    assert index.select() is c
    c.take()
    c.take()  # full: the unlisted one
    assert index.select() is a
    c.release()
    assert index.select() is c  # a place back on a preferred one: it wins again
    assert index.select(exclude={"c"}) is a


def test_without_a_preference_the_rule_is_unchanged() -> None:
    a, b = slot("a", 2), slot("b", 1)
    [(_, index)] = index_models([("m", [a, b])], [a, b]).items()
    assert index.select() is b


def config(state: str = "", capacity: int = 2, declared: int = 0) -> pb.FleetConfig:
    provider = pb.ProviderConfig(
        id="p", type="mock", models=["x"], capacity=capacity, control_state=state
    )
    provider.declared_capacity = declared
    return pb.FleetConfig(
        version=1,
        models=[pb.ModelConfig(id="m", providers={"p": "x"})],
        nodes=[pb.NodeConfig(node_id="n", providers=[provider])],
        runtime_controls=[
            pb.RuntimeControl(kind="prefer", target="m", value="p", change_id="chg_1"),
        ],
    )


def test_a_held_provider_has_no_capacity_and_an_override_is_kept_apart() -> None:
    fleet = fleet_from_proto(config("draining"))
    assert fleet.providers["p"].capacity == 0
    assert fleet.providers["p"].control_state == "draining"
    assert fleet.providers["p"].held_capacity == 2  # its capacity once enabled (views)
    assert fleet.models["m"].preference == ("p",)
    assert [c.change_id for c in fleet.controls] == ["chg_1"]
    overridden = fleet_from_proto(config(capacity=5, declared=2)).providers["p"]
    assert (overridden.capacity, overridden.declared_capacity) == (5, 2)


def reference(members: list[ProviderSlot], preference: list[str]) -> ProviderSlot | None:
    """The rule with a preference, as a scan: (tier, load, position) among free slots."""
    tiers = preference_tiers([s.provider_id for s in members], preference)
    free = [
        (tiers[i], s.in_flight / s.capacity, i)
        for i, s in enumerate(members)
        if s.capacity > 0 and s.in_flight < s.capacity
    ]
    return members[min(free)[2]] if free else None


def test_the_index_with_a_preference_matches_the_scan_under_random_changes() -> None:
    chance = random.Random(34)
    for _ in range(200):
        members = [slot(f"p{i}", 0, chance.randint(1, 4)) for i in range(chance.randint(1, 6))]
        ids = [s.provider_id for s in members]
        preference = chance.sample(ids, chance.randint(0, len(ids)))
        index = ModelIndex("m", members, preference)
        for _ in range(30):
            target = chance.choice(members)
            if chance.random() < 0.6 and target.in_flight < target.capacity:
                target.take()
            elif target.own_in_flight:
                target.release()
            assert index.select() is reference(members, preference)


# ---------------------------------------------------------------- preference and affinity


def a_fleet(preference: tuple[str, ...] = (), held: str = "") -> Fleet:
    providers = {
        pid: ProviderEntry(
            id=pid,
            node_id=f"n-{pid}",
            type="mock",
            category="local_inference",
            models=("m",),
            capacity=0 if pid == held else 4,
            max_queue=8,
            queue_timeout_ms=2_000,
            request_timeout_ms=30_000,
            control_state="disabled" if pid == held else "",
        )
        for pid in ("a", "b", "c")
    }
    model = ModelEntry("m", "m", {pid: "served" for pid in providers}, preference=preference)
    return Fleet(version=1, models={"m": model}, providers=providers)


def turn(session: str) -> RunSpec:
    body = {"model": "m", "messages": [{"role": "user", "content": f"hello from {session}"}]}
    return RunSpec("m", Operation.CHAT_COMPLETIONS, body, True, True, session=session)


async def served_by(edge: WiredDispatcher, session: str) -> str:
    run = await edge.open_run(turn(session))
    run.deliver(Completed(finish_reason="stop"))
    return run.provider_id


async def test_a_preference_starts_new_conversations_and_ongoing_ones_keep_their_cache() -> None:
    edge = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()))
    edge.pool.apply_fleet(a_fleet())
    for pid in ("a", "b", "c"):
        state = pb.ProviderState(provider_id=pid, health=pb.HEALTH_AVAILABLE)
        edge.pool.node_connected(RecordingNodeLink(f"n-{pid}"), provider_reports([state]))
    ongoing = [f"k\x00ongoing-{n}" for n in range(12)]
    before = {session: await served_by(edge, session) for session in ongoing}
    assert len(set(before.values())) > 1  # spread by rendezvous, with no preference
    warm = next(p for p in before.values() if p != "c")  # one not preferred below

    edge.pool.apply_fleet(a_fleet(preference=("c",)))  # an operator: "prefer c"
    new = [await served_by(edge, f"k\x00new-{n}") for n in range(12)]
    assert new == ["c"] * 12  # a new conversation goes where the operator said
    # an ongoing one stays on its warm cache, preferred or not
    assert {session: await served_by(edge, session) for session in ongoing} == before

    edge.pool.apply_fleet(a_fleet(preference=("c",), held=warm))  # its provider held
    moved = [s for s in ongoing if before[s] == warm]
    assert {await served_by(edge, session) for session in moved} == {"c"}
