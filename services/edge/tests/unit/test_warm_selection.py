"""Warm-aware selection (docs/ARCHITECTURE.md#warm-aware-scheduling) through the
dispatcher, with the pool driven as the node listener drives it: snapshots that say which
models each provider holds, runs the test ends itself."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.warmth import WarmPolicy
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.request_run import RequestRun
from iop_edge.testing import RecordingNodeLink
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_proto.v1 import runtime_pb2 as pb

WAIT = 5.0  # a deadline for what must happen, never a pause


def provider(pid: str, capacity: int = 4, max_queue: int = 16) -> ProviderEntry:
    return ProviderEntry(
        id=pid,
        node_id="n",
        type="ollama",
        category="local_inference",
        models=("x", "y"),
        capacity=capacity,
        max_queue=max_queue,
        queue_timeout_ms=30_000,
        request_timeout_ms=30_000,
    )


def state(
    pid: str, loaded: tuple[str, ...] | None, max_loaded: int = 0, mean_ms: int = 0
) -> pb.ProviderState:
    """A provider's snapshot; ``loaded`` None: one that holds every model (no report)."""
    found = pb.ProviderState(provider_id=pid, health=pb.HEALTH_AVAILABLE)
    if loaded is not None:
        timings = [pb.LoadedTiming(name=n, last_ms=mean_ms, mean_ms=mean_ms, loads=1)
                   for n in ("x", "y") if mean_ms]  # fmt: skip
        found.loaded.CopyFrom(
            pb.LoadedModels(
                models=[pb.LoadedModel(name=n) for n in loaded],
                timings=timings,
                max_loaded=max_loaded,
            )
        )
    return found


def wired(
    providers: list[ProviderEntry], models: dict[str, str], warm: WarmPolicy | None = None
) -> tuple[Dispatch, RecordingNodeLink]:
    """``models``: public id -> served name, on every provider."""
    dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()), warm=warm)
    entries = {
        m: ModelEntry(m, m, {p.id: served for p in providers}) for m, served in models.items()
    }
    dispatcher.pool.apply_fleet(Fleet(1, entries, {p.id: p for p in providers}))
    return dispatcher, RecordingNodeLink("n")


def spec(model: str) -> RunSpec:
    return RunSpec(model, Operation.CHAT_COMPLETIONS, {"model": model}, False, False)


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


async def test_the_loaders_count_follows_the_reports_and_a_plain_pool_keeps_the_heap() -> None:
    dispatcher, node = wired([provider("a"), provider("b")], {"m": "x"})
    index = dispatcher.pool.indexes.get("m")
    assert index is not None
    dispatcher.pool.node_connected(node, provider_reports([state("a", None), state("b", None)]))
    assert index.loaders == 0  # vLLM-like: selection never leaves the heap
    run = await dispatcher.open_run(spec("m"))
    assert run.provider_id == "a"  # the seed's rule: the first listed on ties
    dispatcher.pool.apply_snapshot("n", provider_reports([state("b", ())]))
    assert index.loaders == 1
    dispatcher.pool.apply_snapshot("n", provider_reports([state("b", None)]))
    assert index.loaders == 0


async def test_a_provider_holding_the_model_goes_before_a_less_loaded_cold_one() -> None:
    dispatcher, node = wired([provider("a"), provider("b")], {"m": "x"})
    dispatcher.pool.node_connected(node, provider_reports([state("a", ()), state("b", ("x",))]))
    first = await dispatcher.open_run(spec("m"))
    second = await dispatcher.open_run(spec("m"))  # b is busier now, and still preferred
    assert (first.provider_id, second.provider_id) == ("b", "b")


async def test_a_burst_to_a_cold_model_waits_for_one_load_then_takes_the_warm_host() -> None:
    dispatcher, node = wired([provider("a"), provider("b")], {"m": "x"})
    dispatcher.pool.node_connected(node, provider_reports([state("a", ()), state("b", ())]))
    first = await dispatcher.open_run(spec("m"))
    assert first.provider_id == "a"  # a cold host: its load begins
    held = [asyncio.create_task(dispatcher.open_run(spec("m"))) for _ in range(3)]
    await asyncio.sleep(0)  # let them reach the queue
    assert dispatcher.queued("m") == 3  # b is free, but cold: they wait for a's load
    assert [r.provider_id for r in node.sent] == ["a"]
    complete(first)  # a answered: it holds the model now
    runs = await asyncio.wait_for(asyncio.gather(*held), WAIT)
    assert [r.provider_id for r in runs] == ["a", "a", "a"]


async def test_the_load_is_over_at_the_loading_runs_first_delta_not_its_end() -> None:
    dispatcher, node = wired([provider("a", capacity=2), provider("b")], {"m": "x"})
    dispatcher.pool.node_connected(node, provider_reports([state("a", ()), state("b", ())]))
    first = await dispatcher.open_run(spec("m"))
    assert first.provider_id == "a"  # a cold host: its load begins
    held = [asyncio.create_task(dispatcher.open_run(spec("m"))) for _ in range(2)]
    await asyncio.sleep(0)
    assert dispatcher.queued("m") == 2
    # a's first token: the model is in memory there, though the run goes on streaming.
    # a's one free slot goes to the oldest held request now; the other waits for a slot
    # of a (warm, busy: still its home), not for a load on b.
    first.deliver(Delta(text="Hello"))
    second = await asyncio.wait_for(held[0], WAIT)
    assert second.provider_id == "a"
    assert first.outcome is None  # the loading run has not ended
    await asyncio.sleep(0)
    assert dispatcher.queued("m") == 1
    assert [r.provider_id for r in node.sent] == ["a", "a"]
    first.deliver(Delta(text=" there"))  # later deltas change nothing
    complete(first)  # its slot goes to the last one, on a (warm by its runs)
    third = await asyncio.wait_for(held[1], WAIT)
    assert third.provider_id == "a"


async def test_the_hold_ends_after_its_bound_and_the_requests_spread() -> None:
    policy = WarmPolicy(hold_factor=1.0, assumed_load_s=0.2)
    dispatcher, node = wired([provider("a"), provider("b")], {"m": "x"}, policy)
    dispatcher.pool.node_connected(node, provider_reports([state("a", ()), state("b", ())]))
    first = await dispatcher.open_run(spec("m"))
    held = asyncio.create_task(dispatcher.open_run(spec("m")))
    # a's load never ends; after 0.2 s the held request loads the model on b too
    second = await asyncio.wait_for(held, WAIT)
    assert (first.provider_id, second.provider_id) == ("a", "b")


async def test_a_measured_load_time_sets_the_hold() -> None:
    policy = WarmPolicy(hold_factor=1.0, assumed_load_s=60.0)
    dispatcher, node = wired([provider("a"), provider("b")], {"m": "x"}, policy)
    reports = [state("a", (), mean_ms=200), state("b", (), mean_ms=200)]
    dispatcher.pool.node_connected(node, provider_reports(reports))
    await dispatcher.open_run(spec("m"))
    second = await asyncio.wait_for(dispatcher.open_run(spec("m")), WAIT)  # not 60 s
    assert second.provider_id == "b"


async def test_a_full_queue_spreads_instead_of_refusing() -> None:
    dispatcher, node = wired([provider("a", max_queue=1), provider("b", max_queue=1)], {"m": "x"})
    dispatcher.pool.node_connected(node, provider_reports([state("a", ()), state("b", ())]))
    max_queue, _ = dispatcher.fleet.current.queue_limits("m")
    await dispatcher.open_run(spec("m"))  # a loads
    held = [asyncio.create_task(dispatcher.open_run(spec("m"))) for _ in range(max_queue)]
    await asyncio.sleep(0)
    assert dispatcher.queued("m") == max_queue
    # One more would be a 429 with the queue full of held requests: the oldest is let go
    # to the cold host instead, and the newcomer takes its place.
    late = asyncio.create_task(dispatcher.open_run(spec("m")))
    spread = await asyncio.wait_for(held[0], WAIT)
    assert spread.provider_id == "b"
    await asyncio.sleep(0)
    assert not late.done()  # waiting, not refused
    assert dispatcher.queued("m") == max_queue
    for task in [*held, late]:
        task.cancel()


async def test_a_swapping_host_finishes_its_model_first_within_the_grants_bound() -> None:
    policy = WarmPolicy(group_grants=2, group_wait_s=60.0)
    dispatcher, node = wired([provider("p", capacity=1)], {"mx": "x", "my": "y"}, policy)
    dispatcher.pool.node_connected(node, provider_reports([state("p", ("x",), max_loaded=1)]))
    running = await dispatcher.open_run(spec("mx"))
    for_y = asyncio.create_task(dispatcher.open_run(spec("my")))
    await asyncio.sleep(0)
    for_x = [asyncio.create_task(dispatcher.open_run(spec("mx"))) for _ in range(4)]
    await asyncio.sleep(0)
    order: list[str] = []
    for _ in range(3):  # x holds the host: its waiters go first, two in a row at most
        complete(running)
        done, _ = await asyncio.wait([for_y, *for_x], timeout=WAIT, return_when="FIRST_COMPLETED")
        task = next(t for t in [for_y, *for_x] if t in done and t.result() is not None)
        running = task.result()
        order.append(running.model.id)
        for_x = [t for t in for_x if t is not task]
        if task is for_y:
            for_y = asyncio.create_task(asyncio.sleep(3600))  # done with y
    assert order == ["mx", "mx", "my"]
    for task in [for_y, *for_x]:
        task.cancel()
