"""The dispatcher keeps its selection indexes and its metrics current on every path."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import failed as failed_event
from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, ErrorCode, Failed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.outliers import OutlierPolicy, Phase
from iop_edge.domain.pool import ProviderSlot, select
from iop_edge.errors import NoProviderAvailable
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.request_run import RequestRun
from iop_edge.testing import RecordingNodeLink
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_proto.v1 import runtime_pb2 as pb


def provider(pid: str, node: str, capacity: int) -> ProviderEntry:
    return ProviderEntry(
        id=pid,
        node_id=node,
        type="mock",
        category="local_inference",
        models=(pid,),
        capacity=capacity,
        max_queue=4,
        queue_timeout_ms=1_000,
        request_timeout_ms=30_000,
    )


def make_fleet(version: int, providers: list[ProviderEntry], models: dict[str, list[str]]) -> Fleet:
    by_id = {p.id: p for p in providers}
    entries = {
        # as the fleet adapter builds it: providers in the fleet file's order
        m: ModelEntry(m, m, {p.id: f"{m}@{p.id}" for p in providers if p.id in members})
        for m, members in models.items()
    }
    return Fleet(version=version, models=entries, providers=by_id)


def spec(model: str) -> RunSpec:
    return RunSpec(model, Operation.CHAT_COMPLETIONS, {"model": model}, False, False)


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


def candidates(dispatcher: Dispatch, model: str) -> list[ProviderSlot]:
    entry = dispatcher.fleet.current.models[model]
    return [s for p in entry.providers if (s := dispatcher.pool.slot(p)) is not None]


def random_fleet(rng: random.Random, version: int) -> Fleet:
    providers = [
        provider(f"p{i}", f"n{rng.randrange(3)}", rng.choice((0, 1, 2, 3, 4)))
        for i in range(12)
        if rng.random() < 0.85
    ]
    ids = [p.id for p in providers]
    models = {f"m{m}": rng.sample(ids, rng.randint(0, len(ids))) for m in range(3)}
    return make_fleet(version, providers, models)


@pytest.mark.parametrize("seed", range(12))
async def test_every_dispatch_chooses_what_the_scan_chooses(seed: int) -> None:
    rng = random.Random(seed)
    # Outlier ejection at its quickest: 2 failures eject, the cooldown ends at the loop's
    # next turn (the awaits below), so providers go through every state.
    policy = OutlierPolicy(consecutive_failures=2, cooldown_s=0.0)
    dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()), outliers=policy)
    dispatcher.pool.apply_fleet(random_fleet(rng, 1))
    nodes = {n: RecordingNodeLink(n) for n in ("n0", "n1", "n2")}
    runs: list[RequestRun] = []
    ejections: set[str] = set()
    health = (pb.HEALTH_AVAILABLE, pb.HEALTH_AVAILABLE, pb.HEALTH_UNAVAILABLE, pb.HEALTH_UNKNOWN)
    for step in range(400):
        action = rng.random()
        node = rng.choice(list(nodes.values()))
        mine = [p for p in dispatcher.fleet.current.providers.values() if p.node_id == node.node_id]
        states = [
            pb.ProviderState(
                provider_id=p.id, health=rng.choice(health), in_flight=rng.randint(0, 3)
            )
            for p in mine
            if rng.random() < 0.8
        ]
        if action < 0.4:
            model = rng.choice(list(dispatcher.fleet.current.models))
            pool = candidates(dispatcher, model)
            expected = select(pool)
            if expected is not None:
                run = await dispatcher.open_run(spec(model))
                assert run.provider_id == expected.provider_id, (seed, step)
                runs.append(run)
            elif not any(s.usable for s in pool):
                with pytest.raises(NoProviderAvailable):
                    await dispatcher.open_run(spec(model))
        elif action < 0.55 and runs:
            complete(runs.pop(rng.randrange(len(runs))))
        elif action < 0.65 and runs:  # a provider's failure: counts for ejection
            run = runs.pop(rng.randrange(len(runs)))
            if (ending := dispatcher.runs.get(run.attempt_id)) is not None:
                ending.deliver(Failed(ErrorCode.PROVIDER_ERROR, "500", 500))
            await asyncio.sleep(0)  # a cooldown armed before may end now
        elif action < 0.8:
            if dispatcher.pool.links.get(node.node_id) is not None:
                dispatcher.pool.apply_snapshot(node.node_id, provider_reports(states))
            else:
                dispatcher.pool.node_connected(node, provider_reports(states))
        elif action < 0.88 and dispatcher.pool.links.get(node.node_id) is not None:
            dispatcher.pool.node_disconnected(node, "test")
        elif action < 0.94 and runs:
            run = rng.choice(runs)
            failed = pb.RunError(code=pb.ERROR_CODE_PROVIDER_UNAVAILABLE, message="refused")
            if (failing := dispatcher.runs.get(run.run_id)) is not None:
                failing.deliver(failed_event(failed))
        elif action >= 0.97:
            dispatcher.pool.apply_fleet(random_fleet(rng, step + 2))
        runs = [r for r in runs if not r.attempt_finished]
        for slot in dispatcher.pool.slots():
            assert slot.connected == (slot.node_id in dispatcher.pool.links), (seed, step)
            ejected = slot.outlier.phase is Phase.EJECTED
            assert ejected == (slot.provider_id in dispatcher.pool._cooldowns), (seed, step)
            ejections.update([slot.provider_id] if ejected else [])
    assert ejections, seed  # the run went through ejections


async def test_a_freed_shared_slot_goes_to_the_first_model_of_the_fleet_with_waiters() -> None:
    dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()))
    dispatcher.pool.apply_fleet(make_fleet(1, [provider("p", "n", 1)], {"a": ["p"], "b": ["p"]}))
    node = RecordingNodeLink("n")
    dispatcher.pool.node_connected(
        node, provider_reports([pb.ProviderState(provider_id="p", health=pb.HEALTH_AVAILABLE)])
    )
    first = await dispatcher.open_run(spec("b"))
    for_b = asyncio.create_task(dispatcher.open_run(spec("b")))
    await asyncio.sleep(0)
    for_a = asyncio.create_task(dispatcher.open_run(spec("a")))
    await asyncio.sleep(0)
    complete(first)
    await asyncio.wait_for(for_a, 1)  # "a" comes first in the fleet, though "b" waited longer
    assert not for_b.done()
    complete(for_a.result())
    await asyncio.wait_for(for_b, 1)


async def test_a_provider_moved_to_another_node_follows_that_node() -> None:
    registry = CollectorRegistry()
    dispatcher = Dispatch(EdgeMetrics.create(registry))
    dispatcher.pool.apply_fleet(make_fleet(1, [provider("p", "old", 2)], {"m": ["p"]}))
    old = RecordingNodeLink("old")
    dispatcher.pool.node_connected(
        old, provider_reports([pb.ProviderState(provider_id="p", health=pb.HEALTH_AVAILABLE)])
    )
    assert (
        registry.get_sample_value("iop_edge_provider_in_flight", {"provider": "p", "node": "old"})
        == 0
    )
    dispatcher.pool.apply_fleet(make_fleet(2, [provider("p", "new", 2)], {"m": ["p"]}))
    assert not dispatcher.pool.slot("p").connected  # "new" has not registered
    with pytest.raises(NoProviderAvailable):
        await dispatcher.open_run(spec("m"))
    new = RecordingNodeLink("new")
    dispatcher.pool.node_connected(
        new, provider_reports([pb.ProviderState(provider_id="p", health=pb.HEALTH_AVAILABLE)])
    )
    run = await dispatcher.open_run(spec("m"))
    assert new.sent[0].run_id == run.run_id
    labels = {"provider": "p", "node": "new"}
    assert registry.get_sample_value("iop_edge_provider_in_flight", labels) == 1
    old_labels = {"provider": "p", "node": "old"}
    assert registry.get_sample_value("iop_edge_provider_in_flight", old_labels) is None


async def test_metrics_follow_the_pool_and_leave_with_the_fleet() -> None:
    registry = CollectorRegistry()
    dispatcher = Dispatch(EdgeMetrics.create(registry))
    providers = [provider("a", "n", 1), provider("b", "n", 1)]
    dispatcher.pool.apply_fleet(make_fleet(1, providers, {"m": ["a"], "x": ["b"]}))
    node = RecordingNodeLink("n")
    dispatcher.pool.node_connected(
        node,
        provider_reports(
            [
                pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE),
                pb.ProviderState(provider_id="b", health=pb.HEALTH_UNKNOWN),
            ]
        ),
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("iop_edge_provider_health", provider="a", state="available") == 1
    assert value("iop_edge_provider_health", provider="b", state="unknown") == 1
    assert value("iop_edge_provider_health", provider="b", state="available") == 0
    run = await dispatcher.open_run(spec("m"))
    assert value("iop_edge_provider_in_flight", provider="a", node="n") == 1
    waiting = asyncio.create_task(dispatcher.open_run(spec("m")))
    await asyncio.sleep(0)
    assert value("iop_edge_model_queued", model="m") == 1
    complete(run)
    complete(await asyncio.wait_for(waiting, 1))
    assert value("iop_edge_model_queued", model="m") == 0
    assert value("iop_edge_provider_in_flight", provider="a", node="n") == 0
    dispatcher.pool.node_disconnected(node, "gone")
    assert value("iop_edge_provider_health", provider="a", state="unavailable") == 1
    assert value("iop_edge_provider_health", provider="a", state="available") == 0

    dispatcher.pool.apply_fleet(make_fleet(2, providers[1:], {"x": ["b"]}))
    assert value("iop_edge_provider_in_flight", provider="a", node="n") is None
    assert value("iop_edge_provider_health", provider="a", state="unavailable") is None
    assert value("iop_edge_model_queued", model="m") is None
    assert value("iop_edge_provider_health", provider="b", state="unavailable") == 1


async def test_the_pool_gauges_show_every_provider_and_model_of_the_fleet_as_it_is() -> None:
    # Read from the pool at scrape time: a provider whose node never registered shows as
    # unavailable with nothing in flight, a model nobody queued for as 0 waiting, and a
    # node's snapshot shows at once, with no change of the pool published anywhere.
    registry = CollectorRegistry()
    dispatcher = Dispatch(EdgeMetrics.create(registry))
    providers = [provider("a", "n", 2), provider("b", "silent", 1)]
    dispatcher.pool.apply_fleet(make_fleet(1, providers, {"m": ["a", "b"]}))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("iop_edge_provider_health", provider="b", state="unavailable") == 1
    assert value("iop_edge_provider_in_flight", provider="b", node="silent") == 0
    assert value("iop_edge_provider_ejected", provider="b") == 0
    assert value("iop_edge_model_queued", model="m") == 0
    node = RecordingNodeLink("n")
    state = pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE, in_flight=2)
    dispatcher.pool.node_connected(node, provider_reports([state]))
    assert value("iop_edge_provider_in_flight", provider="a", node="n") == 2  # other edges'
    assert value("iop_edge_provider_health", provider="a", state="available") == 1
    assert value("iop_edge_provider_health", provider="b", state="unavailable") == 1
