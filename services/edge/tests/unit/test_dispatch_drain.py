"""The dispatcher's part of a graceful stop: no new run, the ones in flight finish, the rest
end with ``ShuttingDown``."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, Failed, RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.errors import ShuttingDown
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.request_run import RequestRun
from iop_edge.settings import EdgeSettings
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_edge.testing import read_all
from iop_proto.v1 import runtime_pb2 as pb


class FakeNode:
    node_id = "node-a"
    acknowledges_runs = False

    async def send_run(self, request: RunOrder) -> None:
        pass

    async def send_cancel(self, run_id: str, reason: str) -> None:
        pass


def fleet() -> Fleet:
    provider = ProviderEntry(
        id="a",
        node_id="node-a",
        type="mock",
        category="local_inference",
        models=("served",),
        capacity=1,
        max_queue=2,
        queue_timeout_ms=5000,
        request_timeout_ms=30_000,
    )
    model = ModelEntry("m", "M", {"a": "served"})
    return Fleet(version=1, models={model.id: model}, providers={"a": provider})


def spec() -> RunSpec:
    return RunSpec("m", Operation.CHAT_COMPLETIONS, {"messages": []}, True, False)


def available(dispatcher: Dispatch) -> None:
    state = pb.ProviderState(provider_id="a", health=pb.HEALTH_AVAILABLE)
    dispatcher.pool.node_connected(FakeNode(), provider_reports([state]))


def complete(run: RequestRun) -> None:
    run.deliver(Completed(finish_reason="stop"))


@pytest.fixture
def dispatcher() -> Dispatch:
    d = Dispatch(EdgeMetrics.create(CollectorRegistry()))
    d.pool.apply_fleet(fleet())
    return d


async def test_draining_refuses_new_and_queued_runs_and_waits_for_those_in_flight(
    dispatcher: Dispatch,
) -> None:
    available(dispatcher)
    running = await dispatcher.open_run(spec())
    queued = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)  # it waits in the model's queue
    assert not dispatcher.idle
    dispatcher.stop_admitting("edge is stopping")
    with pytest.raises(ShuttingDown):
        await dispatcher.open_run(spec())
    with pytest.raises(ShuttingDown):
        await queued  # at once, not started later only to be cut at the drain's end
    idle = asyncio.create_task(dispatcher.wait_idle())
    await asyncio.sleep(0)
    assert not idle.done()  # the run in flight goes on
    complete(running)
    await asyncio.wait_for(idle, 1)
    assert dispatcher.idle
    assert dispatcher.runs_in_flight() == 0


async def test_what_outlasts_the_drain_ends_with_an_error(dispatcher: Dispatch) -> None:
    available(dispatcher)
    running = await dispatcher.open_run(spec())
    queued = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)
    await dispatcher.fail_all("edge is stopping")
    with pytest.raises(ShuttingDown):
        await queued  # a 503 for its client
    events = await read_all(running)
    assert isinstance(events[-1], Failed)  # a stream's last SSE event
    assert dispatcher.idle


async def test_a_waiter_handed_a_slot_just_before_fail_all_ends_once_and_frees_it(
    dispatcher: Dispatch,
) -> None:
    available(dispatcher)
    running = await dispatcher.open_run(spec())
    queued = asyncio.create_task(dispatcher.open_run(spec()))
    await asyncio.sleep(0)  # it waits in the model's queue
    complete(running)  # its slot goes to the queued request, whose run has not started yet
    await dispatcher.fail_all("edge is stopping")
    with pytest.raises(ShuttingDown):
        await queued  # one outcome, a 503 for its client, rather than a run nobody ends
    assert dispatcher.runs_in_flight() == 0
    assert dispatcher.idle  # and its slot is free


def test_the_shutdown_reserve_must_leave_time_to_drain() -> None:
    tls = {"ca_file": "ca.pem", "cert_file": "e.pem", "key_file": "e.key"}
    settings = EdgeSettings(service_id="edge", tls=tls, shutdown_timeout_s=10)
    assert settings.drain_s == 8.0
    with pytest.raises(ValidationError, match="shutdown_reserve_s"):
        EdgeSettings(service_id="edge", tls=tls, shutdown_timeout_s=2, shutdown_reserve_s=2)
