"""A node's CacheState reaches its provider's slot (``ProviderSlot.cache``) as plain data:
it replaces the last report, and moves nothing selection indexes by load."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import cache_report, provider_reports
from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.events import RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, ProviderEntry
from iop_edge.domain.pool import ProviderSlot
from iop_edge.metrics import EdgeMetrics
from iop_edge.service.registry import ProviderRegistry
from iop_edge.testing import WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb

TAIL = 2**64 - 5  # a hash past the signed range: fixed64 carries it whole


class FakeNode:
    node_id = "n"
    acknowledges_runs = False

    async def send_run(self, request: RunOrder) -> None:
        """Never called: no run is started here."""

    async def send_cancel(self, run_id: str, reason: str) -> None:
        """Never called."""


def registry_with_provider() -> tuple[ProviderRegistry, ProviderSlot]:
    dispatcher = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()))
    entry = ProviderEntry(
        id="p",
        node_id="n",
        type="llamacpp",
        category="local_inference",
        models=("m",),
        capacity=2,
        max_queue=4,
        queue_timeout_ms=5_000,
        request_timeout_ms=30_000,
    )
    fleet = Fleet(version=1, models={"m": ModelEntry("m", "m", {"p": "m"})}, providers={"p": entry})
    dispatcher.pool.apply_fleet(fleet)
    dispatcher.pool.node_connected(FakeNode(), [])
    slot = dispatcher.pool.slot("p")
    assert slot is not None
    return dispatcher.pool, slot


def state(cache: pb.CacheState | None) -> pb.ProviderState:
    provider = pb.ProviderState(provider_id="p", health=pb.HEALTH_AVAILABLE, in_flight=1)
    if cache is not None:
        provider.cache.CopyFrom(cache)
    return provider


def test_a_cache_state_becomes_a_report_keyed_by_tail() -> None:
    cache = pb.CacheState(
        prefixes=[pb.CachedPrefix(tail=TAIL, blocks=9), pb.CachedPrefix(tail=3, blocks=2)],
        prompt_tokens=1000,
        cached_tokens=750,
        prefill_ms_per_token=0.5,
    )
    report = cache_report(pb.CacheState.FromString(cache.SerializeToString()))
    assert report == CacheReport({TAIL: 9, 3: 2}, 1000, 750, 0.5)
    assert report.hit_rate == 0.75


def test_a_rate_of_zero_is_unknown_and_a_tail_named_twice_keeps_its_newest_length() -> None:
    cache = pb.CacheState(
        prefixes=[pb.CachedPrefix(tail=7, blocks=4), pb.CachedPrefix(tail=7, blocks=3)]
    )
    assert cache_report(cache) == CacheReport({7: 4}, 0, 0, None)


def test_a_state_without_a_cache_reports_none() -> None:
    (report,) = provider_reports([state(None)])
    assert report.cache is None
    (report,) = provider_reports([state(pb.CacheState())])
    assert report.cache == CacheReport()


def test_a_snapshot_sets_the_slots_cache_without_touching_its_load() -> None:
    registry, slot = registry_with_provider()
    registry.apply_snapshot("n", provider_reports([state(None)]))
    version = slot.version
    held = pb.CacheState(prefixes=[pb.CachedPrefix(tail=TAIL, blocks=9)], prompt_tokens=10)
    registry.apply_snapshot("n", provider_reports([state(held)]))
    assert slot.cache == CacheReport({TAIL: 9}, 10, 0, None)
    assert slot.version == version  # no index entry went stale: the load is as it was


def test_an_empty_account_clears_and_a_silent_node_keeps_the_last_report() -> None:
    registry, slot = registry_with_provider()
    held = pb.CacheState(prefixes=[pb.CachedPrefix(tail=1, blocks=1)])
    registry.apply_snapshot("n", provider_reports([state(held)]))
    registry.apply_snapshot("n", provider_reports([state(None)]))  # a node that does not say
    assert slot.cache.held == {1: 1}
    registry.apply_snapshot("n", provider_reports([state(pb.CacheState(prompt_tokens=4))]))
    assert slot.cache == CacheReport({}, 4, 0, None)  # the engine's cache is gone


def test_another_nodes_snapshot_does_not_set_the_cache() -> None:
    registry, slot = registry_with_provider()
    held = pb.CacheState(prefixes=[pb.CachedPrefix(tail=1, blocks=1)])
    registry.apply_snapshot("other", provider_reports([state(held)]))
    assert slot.cache == CacheReport()
