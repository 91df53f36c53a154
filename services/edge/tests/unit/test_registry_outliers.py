"""Outlier ejection through the dispatcher and the registry, on a real event loop: runs'
ends reach the registry, the cooldown timer puts the provider on trial and serves the
queues, the catalog and the metrics say why."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, ErrorCode, Failed, RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.outliers import OutlierPolicy
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.catalog import PoolCatalog
from iop_edge.service.request_run import RequestRun
from iop_edge.settings import EdgeSettings
from iop_edge.testing import WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb

COOLDOWN_S = 0.05
POLICY = OutlierPolicy(consecutive_failures=2, cooldown_s=COOLDOWN_S, max_cooldown_s=0.1)
FIVE_HUNDRED = Failed(ErrorCode.PROVIDER_ERROR, "HTTP 500", provider_status=500)


class FakeNode:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.sent: list[RunOrder] = []

    async def send_run(self, request: RunOrder) -> None:
        self.sent.append(request)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        """Nothing to do: the tests end runs themselves."""


def provider(pid: str, capacity: int) -> ProviderEntry:
    return ProviderEntry(
        id=pid,
        node_id="n",
        type="mock",
        category="local_inference",
        models=(pid,),
        capacity=capacity,
        max_queue=4,
        queue_timeout_ms=5_000,
        request_timeout_ms=30_000,
    )


class Pool:
    """A model ``m`` served by ``flaky`` (listed first) and ``steady``, on one node."""

    def __init__(self, capacity: int = 1, policy: OutlierPolicy = POLICY) -> None:
        self.registry = CollectorRegistry()
        self.dispatcher = WiredDispatcher(EdgeMetrics.create(self.registry), outliers=policy)
        providers = [provider("flaky", capacity), provider("steady", capacity)]
        entry = ModelEntry("m", "m", {"flaky": "m-flaky", "steady": "m-steady"})
        fleet = Fleet(version=1, models={"m": entry}, providers={p.id: p for p in providers})
        self.dispatcher.pool.apply_fleet(fleet)
        self.node = FakeNode("n")
        states = [pb.ProviderState(provider_id=p.id, health=pb.HEALTH_AVAILABLE) for p in providers]
        self.dispatcher.pool.node_connected(self.node, provider_reports(states))
        self.catalog = PoolCatalog(self.dispatcher.fleet, self.dispatcher.pool, self.dispatcher)

    async def run(self) -> RequestRun:
        """The first attempt of a new request (nobody reads it: no failover follows)."""
        spec = RunSpec("m", Operation.CHAT_COMPLETIONS, {"model": "m"}, False, False)
        return await self.dispatcher.open_run(spec)

    def end(self, run: RequestRun, event: Completed | Failed) -> None:
        assert run.run_id in self.dispatcher.runs
        run.deliver(event)

    def row(self, provider_id: str) -> dict[str, object]:
        return next(r for r in self.catalog.provider_views() if r["provider_id"] == provider_id)

    def metric(self, name: str, provider_id: str) -> float | None:
        return self.registry.get_sample_value(name, {"provider": provider_id})


async def test_failures_in_a_row_eject_and_the_catalog_and_metrics_say_so() -> None:
    pool = Pool()
    assert pool.metric("iop_edge_provider_ejected", "flaky") == 0
    assert pool.metric("iop_edge_ejections_total", "flaky") == 0
    first = await pool.run()
    assert first.provider_id == "flaky"
    pool.end(first, FIVE_HUNDRED)
    assert pool.row("flaky")["consecutive_failures"] == 1
    before_ms = time.time() * 1000
    second = await pool.run()
    assert second.provider_id == "flaky"
    pool.end(second, FIVE_HUNDRED)
    row = pool.row("flaky")
    assert row["health"] == "available"  # the node's word, unchanged
    assert row["outlier_state"] == "ejected"
    assert row["ejected"] is True
    until_ms = row["ejected_until_ms"]
    assert isinstance(until_ms, int)
    cooldown_ms = COOLDOWN_S * 1000
    assert before_ms + cooldown_ms - 1 <= until_ms <= time.time() * 1000 + cooldown_ms + 1
    assert row["consecutive_failures"] == 2
    assert pool.metric("iop_edge_provider_ejected", "flaky") == 1
    assert pool.metric("iop_edge_ejections_total", "flaky") == 1
    assert "flaky" not in pool.catalog.model_views()[0]["available_providers"]
    third = await pool.run()
    assert third.provider_id == "steady"  # flaky is listed first, but ejected


async def test_the_cooldown_ends_in_one_trial_that_decides() -> None:
    pool = Pool(capacity=1)
    for _ in range(2):
        pool.end(await pool.run(), FIVE_HUNDRED)
    hold = await pool.run()
    assert hold.provider_id == "steady"  # steady is full now: the next request waits
    trial_task = asyncio.create_task(pool.run())
    # the cooldown's timer puts flaky on trial and serves the queue: the waiter gets it
    trial = await asyncio.wait_for(trial_task, 5)
    assert trial.provider_id == "flaky"
    row = pool.row("flaky")
    assert (row["outlier_state"], row["ejected"], row["ejected_until_ms"]) == (
        "half_open",
        False,
        None,
    )
    assert pool.metric("iop_edge_provider_ejected", "flaky") == 0
    waiting = asyncio.create_task(pool.run())  # flaky's one trial is out, steady is full
    await asyncio.sleep(0)
    assert not waiting.done()
    pool.end(trial, FIVE_HUNDRED)  # the trial fails: ejected again, for twice as long
    assert pool.row("flaky")["outlier_state"] == "ejected"
    assert pool.metric("iop_edge_ejections_total", "flaky") == 2
    assert not waiting.done()  # the freed slot is flaky's, and flaky is out
    pool.end(hold, Completed(finish_reason="stop"))
    assert (await asyncio.wait_for(waiting, 1)).provider_id == "steady"

    # the next cooldown over, a trial that completes puts flaky back, counters reset
    busy = waiting.result()  # steady is full again
    second_trial = await asyncio.wait_for(pool.run(), 5)
    assert second_trial.provider_id == "flaky"
    pool.end(second_trial, Completed(finish_reason="stop"))
    row = pool.row("flaky")
    assert (row["outlier_state"], row["consecutive_failures"]) == ("closed", 0)
    pool.end(busy, Completed(finish_reason="stop"))
    assert (await pool.run()).provider_id == "flaky"  # first listed, in selection again


async def test_only_provider_failures_count() -> None:
    pool = Pool(capacity=4)
    for event in (
        Failed(ErrorCode.CANCELLED, "client gone"),
        Failed(ErrorCode.PROVIDER_ERROR, "HTTP 400", provider_status=400),
        Failed(ErrorCode.DEADLINE_EXCEEDED, "the client's deadline"),
        Failed(ErrorCode.QUEUE_TIMEOUT, "the node's queue"),
        FIVE_HUNDRED,
        Completed(finish_reason="stop"),
        FIVE_HUNDRED,
    ):
        run = await pool.run()
        assert run.provider_id == "flaky"
        pool.end(run, event)
    assert pool.row("flaky")["outlier_state"] == "closed"
    assert pool.row("flaky")["consecutive_failures"] == 1
    cancelled = await pool.run()
    await cancelled.cancel("client gone")  # the edge's own cancellation: no verdict either
    assert pool.row("flaky")["consecutive_failures"] == 1


async def test_runs_lost_with_the_node_link_do_not_count() -> None:
    pool = Pool(capacity=4)
    runs = [await pool.run() for _ in range(4)]
    assert {r.provider_id for r in runs} == {"flaky", "steady"}
    pool.dispatcher.pool.node_disconnected(pool.node, "heartbeat missed")
    assert all(r.attempt_finished for r in runs)
    assert pool.row("flaky")["consecutive_failures"] == 0


async def test_off_never_ejects() -> None:
    pool = Pool(capacity=4, policy=OutlierPolicy(consecutive_failures=0))
    for _ in range(10):
        run = await pool.run()
        assert run.provider_id == "flaky"
        pool.end(run, FIVE_HUNDRED)
    assert pool.row("flaky")["outlier_state"] == "closed"


async def test_a_provider_leaving_the_fleet_takes_its_cooldown_along() -> None:
    pool = Pool()
    for _ in range(2):
        pool.end(await pool.run(), FIVE_HUNDRED)
    assert pool.dispatcher.pool._cooldowns  # the timer is armed
    steady = provider("steady", 1)
    entry = ModelEntry("m", "m", {"steady": "m-steady"})
    fleet = Fleet(version=2, models={"m": entry}, providers={"steady": steady})
    pool.dispatcher.pool.apply_fleet(fleet)
    assert not pool.dispatcher.pool._cooldowns
    assert pool.metric("iop_edge_provider_ejected", "flaky") is None
    assert pool.metric("iop_edge_ejections_total", "flaky") is None


def test_the_settings_give_the_policy_and_refuse_a_cap_below_the_cooldown() -> None:
    tls = {"ca_file": "ca.pem", "cert_file": "e.pem", "key_file": "e.key"}
    settings = EdgeSettings(service_id="edge", tls=tls)
    assert settings.outliers == OutlierPolicy(5, 30.0, 300.0)
    off = EdgeSettings(service_id="edge", tls=tls, outlier_consecutive_failures=0)
    assert not off.outliers.enabled
    with pytest.raises(ValidationError, match="outlier_max_cooldown_s"):
        EdgeSettings(service_id="edge", tls=tls, outlier_cooldown_s=60, outlier_max_cooldown_s=30)
