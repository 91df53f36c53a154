"""NodeCore and the cache account: a provider's engine seen down or restarted has lost its
cache, and the snapshot says so; the snapshot carries the account."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from iop_node.domain.cache_account import CacheView
from iop_node.domain.health import Health, ProbeResult
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, ExecutionSpec
from iop_node.entrypoints import wire
from iop_node.metrics import NodeMetrics
from iop_node.ports import AdapterContext, EventSink, LifecycleFlags
from iop_node.service.providers import NodeCore, ProbeSettings
from iop_node.testing import NoHistory
from iop_proto.v1 import runtime_pb2 as pb

CONFIG = ProviderConfig(id="p1", type="fake", models=("m",))


@dataclass
class Engine:
    """What the fake adapters of one provider probe: up or down, and its models."""

    up: bool = True
    models: tuple[str, ...] = ("m",)
    adapters: list[FakeAdapter] = field(default_factory=list)


@dataclass
class FakeAdapter:
    engine: Engine

    @property
    def name(self) -> str:
        return "fake"

    def capabilities(self) -> LifecycleFlags:
        return LifecycleFlags()

    async def probe(self) -> ProbeResult:
        return ProbeResult(ok=self.engine.up, models=self.engine.models)

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        return Completion("stop")

    async def aclose(self) -> None:
        pass


@pytest.fixture
async def node() -> AsyncIterator[tuple[NodeCore, Engine]]:
    engine = Engine()

    def factory(config: ProviderConfig, context: AdapterContext) -> FakeAdapter:
        adapter = FakeAdapter(engine)
        engine.adapters.append(adapter)
        return adapter

    async with aiohttp.ClientSession() as http:
        core = NodeCore(
            "node-a",
            {"fake": factory},
            AdapterContext(http, {}),
            NoHistory(),
            NodeMetrics.create(CollectorRegistry()),
            ProbeSettings(interval_s=3600, rise=1, fall=1),
            cache_prefixes=2,
        )
        await core.apply_config([CONFIG])
        try:
            yield core, engine
        finally:
            await core.aclose()


def held(core: NodeCore) -> tuple[tuple[int, int], ...]:
    return core.providers["p1"].cache.view.prefixes


async def test_the_setting_bounds_each_providers_account(node: tuple[NodeCore, Engine]) -> None:
    core, _ = node
    for n in range(4):
        core.providers["p1"].cache.served([n])
    assert held(core) == ((3, 1), (2, 1))


async def test_a_provider_seen_down_forgets_its_cache(node: tuple[NodeCore, Engine]) -> None:
    core, engine = node
    await core.probe_once("p1")
    core.providers["p1"].cache.served([1, 2], prompt_tokens=40)
    await core.probe_once("p1")
    assert held(core) == ((2, 2),)  # an engine still up keeps what it holds
    engine.up = False
    assert await core.probe_once("p1")
    assert core.providers["p1"].health.state is Health.UNAVAILABLE
    assert held(core) == ()
    assert core.providers["p1"].cache.view.prompt_tokens == 40


async def test_one_failed_probe_forgets_though_health_waits_for_more(
    node: tuple[NodeCore, Engine],
) -> None:
    """An engine restarted between two probes fails one: its cache is gone, while the
    health's hysteresis (``fall``) rightly keeps it in the pool."""
    core, engine = node
    core.providers["p1"].health.fall = 2
    await core.probe_once("p1")
    core.providers["p1"].cache.served([1, 2])
    engine.up = False
    assert not await core.probe_once("p1")
    assert core.providers["p1"].health.state is Health.AVAILABLE
    assert held(core) == ()


async def test_a_provider_with_other_models_forgets_its_cache(
    node: tuple[NodeCore, Engine],
) -> None:
    core, engine = node
    await core.probe_once("p1")
    core.providers["p1"].cache.served([1, 2])
    engine.models = ("m", "other")
    await core.probe_once("p1")
    assert held(core) == ()


async def test_a_provider_moved_to_another_engine_forgets_its_cache(
    node: tuple[NodeCore, Engine],
) -> None:
    core, _ = node
    core.providers["p1"].cache.served([1, 2])
    await core.apply_config([ProviderConfig(id="p1", type="fake", models=("m", "n"))])
    assert held(core) == ((2, 2),)  # new served names, the same engine
    moved = ProviderConfig(id="p1", type="fake", models=("m",), settings={"endpoint": "b"})
    await core.apply_config([moved])
    assert held(core) == ()


async def test_the_snapshot_carries_the_account(node: tuple[NodeCore, Engine]) -> None:
    core, _ = node
    core.providers["p1"].cache.served(
        [11, 2**64 - 1], prompt_tokens=500, cached_tokens=450, prefill_ms_per_token=0.25
    )
    (status,) = core.states()
    assert status.cache == CacheView(((2**64 - 1, 2),), 500, 450, 0.25)
    state = wire.provider_state(status)
    assert state.cache == pb.CacheState(
        prefixes=[pb.CachedPrefix(tail=2**64 - 1, blocks=2)],
        prompt_tokens=500,
        cached_tokens=450,
        prefill_ms_per_token=0.25,
    )
    # the wire form survives the trip (fixed64 holds the whole hash)
    assert pb.ProviderState.FromString(state.SerializeToString()).cache == state.cache


async def test_a_provider_that_served_nothing_still_says_so(
    node: tuple[NodeCore, Engine],
) -> None:
    """An empty account is sent, not left out: the edge then drops what it had (the
    engine restarted), where a snapshot without the field leaves it be."""
    core, _ = node
    (status,) = core.states()
    state = pb.ProviderState.FromString(wire.provider_state(status).SerializeToString())
    assert state.HasField("cache")
    assert state.cache == pb.CacheState()
