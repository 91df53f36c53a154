"""Session affinity across edges (docs/ARCHITECTURE.md#limits-and-affinity-across-edges):
a session's first turn goes to its rendezvous provider, so two edges that share nothing
but the pool's view start it on the same provider; sessions spread by capacity; the
bounded load and each edge's own record still decide as before."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.affinity import RENDEZVOUS, SESSION, AffinityPolicy, CacheAffinity
from iop_edge.domain.events import Completed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.pool import AVAILABLE, ProviderSlot
from iop_edge.domain.rendezvous import ranked
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import RecordingNodeLink, WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb

SESSIONS = [f"key-1\x00session-{n}" for n in range(600)]


def slot(pid: str, capacity: int = 1, in_flight: int = 0) -> ProviderSlot:
    made = ProviderSlot(pid, "n", capacity=capacity, connected=True, health=AVAILABLE)
    made.own_in_flight = in_flight
    return made


def start(affinity: CacheAffinity, members: list[ProviderSlot], session: str) -> str | None:
    preference = affinity.rendezvous(members, session, now=0)
    return None if preference is None else preference.slot.provider_id


def test_two_edges_start_each_new_session_on_the_same_provider_spread_by_capacity() -> None:
    edge_a, edge_b = CacheAffinity(AffinityPolicy()), CacheAffinity(AffinityPolicy())
    pool_a = [slot("a", 2), slot("b", 2), slot("c", 4)]
    pool_b = [slot("a", 2), slot("b", 2), slot("c", 4)]  # the other edge's view, same state
    on_a = [start(edge_a, pool_a, session) for session in SESSIONS]
    on_b = [start(edge_b, list(reversed(pool_b)), session) for session in SESSIONS]
    assert on_a == on_b  # the fleet's order plays no part either
    spread = Counter(on_a)
    # c has half the capacity: about half the sessions (600 draws, a wide margin).
    assert 230 <= spread["c"] <= 370
    assert spread["a"] >= 90
    assert spread["b"] >= 90
    preference = edge_a.rendezvous(pool_a, SESSIONS[0], now=0)
    assert preference is not None
    assert (preference.reason, preference.matched_blocks, preference.wait_s) == (RENDEZVOUS, 0, 0)


def test_a_provider_leaving_moves_only_its_own_sessions() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    pool = [slot("a"), slot("b"), slot("c"), slot("d")]
    before = {session: start(affinity, pool, session) for session in SESSIONS}
    after = {session: start(affinity, pool[:3], session) for session in SESSIONS}
    moved = {session for session in SESSIONS if before[session] != after[session]}
    assert moved == {session for session in SESSIONS if before[session] == "d"}
    assert moved  # d had its share


def test_the_bounded_load_and_the_candidates_still_decide() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    pool = [slot("a", 4), slot("b", 4), slot("c", 4)]
    session = SESSIONS[0]
    first, second, third = (s.provider_id for s in ranked(session, pool))
    by_id = {s.provider_id: s for s in pool}
    by_id[first].own_in_flight = 4  # full, far past its share of a pool of 12 slots
    assert start(affinity, pool, session) == second
    retry = affinity.rendezvous(pool, session, now=0, exclude={second})  # a failover's
    assert retry is not None
    assert retry.slot.provider_id == third
    by_id[second].health = "unavailable"
    assert start(affinity, pool, session) == third
    assert affinity.rendezvous(pool, session, now=0, exclude={third}) is None  # one left


def test_a_session_this_edge_remembers_follows_its_table_not_the_hash() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    pool = [slot("a"), slot("b"), slot("c")]
    session = SESSIONS[1]
    last = ranked(session, pool)[-1]
    affinity.placed("m", last, session, (), now=0)
    assert affinity.rendezvous(pool, session, now=1) is None
    preference = affinity.prefer("m", pool, session, (), now=1)
    assert preference is not None
    assert (preference.slot, preference.reason) == (last, SESSION)
    # Off, or no session: nothing.
    assert CacheAffinity(AffinityPolicy(enabled=False)).rendezvous(pool, session, 0) is None
    assert affinity.rendezvous(pool, None, now=1) is None


def test_a_session_key_with_undecodable_header_bytes_still_hashes() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    assert start(affinity, [slot("a"), slot("b")], "k\x00caf\udce9") in {"a", "b"}


# ---------------------------------------------------------------- through two dispatchers


def fleet(pids: tuple[str, ...] = ("a", "b", "c")) -> Fleet:
    providers = {
        pid: ProviderEntry(
            id=pid,
            node_id=f"n-{pid}",
            type="mock",
            category="local_inference",
            models=("m",),
            capacity=4,
            max_queue=8,
            queue_timeout_ms=2_000,
            request_timeout_ms=30_000,
        )
        for pid in pids
    }
    model = ModelEntry("m", "m", {pid: "served" for pid in providers})
    return Fleet(version=1, models={"m": model}, providers=providers)


def an_edge() -> WiredDispatcher:
    dispatcher = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()))
    dispatcher.pool.apply_fleet(fleet())
    for pid in ("a", "b", "c"):
        state = pb.ProviderState(provider_id=pid, health=pb.HEALTH_AVAILABLE)
        dispatcher.pool.node_connected(RecordingNodeLink(f"n-{pid}"), provider_reports([state]))
    return dispatcher


def first_turn(session: str) -> RunSpec:
    body = {"model": "m", "messages": [{"role": "user", "content": f"hello from {session}"}]}
    return RunSpec("m", Operation.CHAT_COMPLETIONS, body, True, True, session=session)


async def test_two_dispatchers_send_each_new_session_to_the_same_provider() -> None:
    edge_a, edge_b = an_edge(), an_edge()
    # Edge A carries a run of its own the other does not see yet: the seed's rule alone
    # (least loaded, then the fleet's order) would start A's sessions elsewhere than B's.
    await edge_a.open_run(RunSpec("m", Operation.CHAT_COMPLETIONS, {"model": "m"}, True, True))
    chosen: list[str] = []
    for session in SESSIONS[:150]:
        answers = []
        for edge in (edge_a, edge_b):
            run = await edge.open_run(first_turn(session))
            answers.append(run.provider_id)
            run.deliver(Completed(finish_reason="stop"))
        assert answers[0] == answers[1], session
        chosen.append(answers[0])
    spread = Counter(chosen)
    assert set(spread) == {"a", "b", "c"}
    assert min(spread.values()) >= 25  # about 50 each
    # The next turn of a session reaching edge B finds B's record: the same provider.
    run = await edge_b.open_run(first_turn(SESSIONS[0]))
    assert run.provider_id == chosen[0]
