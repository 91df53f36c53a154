"""A request pinned to one provider (``x-iop-provider``, docs/ARCHITECTURE.md#qualification-
reports), on the real dispatcher with fake node links: it goes to that provider only,
waits for it rather than taking another's free slot, never fails over elsewhere, and a
pin the model does not have is a 400; the header is an operator's."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, ErrorCode, Failed, RunEvent, RunOrder
from iop_edge.domain.fleet import ApiKeyEntry, Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.pin import PinUnknown, pinned_out
from iop_edge.entrypoints.routing_hints import routing_hints
from iop_edge.errors import InvalidRequest, OperatorOnly
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import WiredDispatcher, read_all
from iop_proto.v1 import runtime_pb2 as pb

MODEL = "m"
OPS = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True)
ALICE = ApiKeyEntry("key_a", "alice", "hash-a", frozenset(), 0)


class FakeNode:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.sent: list[RunOrder] = []
        self.got_run = asyncio.Event()

    async def send_run(self, request: RunOrder) -> None:
        self.sent.append(request)
        self.got_run.set()

    async def send_cancel(self, run_id: str, reason: str) -> None:
        """Nothing to cancel on a fake."""


class Pool:
    """Providers ``a`` and ``b`` of one model (capacity 1 each), on ``node-a``, ``node-b``."""

    def __init__(self) -> None:
        self.dispatcher = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()))
        entries = {
            pid: ProviderEntry(
                id=pid,
                node_id=f"node-{pid}",
                type="mock",
                category="local_inference",
                models=(MODEL,),
                capacity=1,
                max_queue=4,
                queue_timeout_ms=5_000,
                request_timeout_ms=30_000,
            )
            for pid in ("a", "b")
        }
        model = ModelEntry(MODEL, MODEL, {pid: MODEL for pid in entries}, retries=2)
        self.dispatcher.pool.apply_fleet(Fleet(1, {MODEL: model}, entries))
        self.nodes = {pid: FakeNode(e.node_id) for pid, e in entries.items()}
        for pid, node in self.nodes.items():
            state = pb.ProviderState(provider_id=pid, health=pb.HEALTH_AVAILABLE)
            self.dispatcher.pool.node_connected(node, provider_reports([state]))

    def deliver(self, pid: str, *events: RunEvent) -> None:
        run = self.dispatcher.runs.get(self.nodes[pid].sent[-1].run_id)
        assert run is not None
        for event in events:
            run.deliver(event)

    def sent(self) -> dict[str, int]:
        return {pid: len(node.sent) for pid, node in self.nodes.items()}


def spec(pin: str = "") -> RunSpec:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return RunSpec(MODEL, Operation.CHAT_COMPLETIONS, body, False, False, pin=pin)


@pytest.mark.parametrize("pin", ["b", "node-b/b"])
async def test_a_pinned_request_goes_to_its_provider_though_the_first_is_as_free(
    pin: str,
) -> None:
    pool = Pool()
    unpinned = await pool.dispatcher.open_run(spec())
    assert unpinned.provider_id == "a"  # the first listed on ties: what a pin overrides
    pool.deliver("a", Completed(finish_reason="stop"))
    await read_all(unpinned)
    run = await pool.dispatcher.open_run(spec(pin))
    assert (run.provider_id, run.node_id) == ("b", "node-b")
    assert pool.sent() == {"a": 1, "b": 1}


async def test_a_pinned_request_waits_for_its_provider_rather_than_take_another() -> None:
    pool = Pool()
    busy = await pool.dispatcher.open_run(spec("b"))
    waiting = asyncio.create_task(pool.dispatcher.open_run(spec("b")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()  # a is free, but it is not the pinned one
    assert pool.sent() == {"a": 0, "b": 1}
    pool.deliver("b", Completed(finish_reason="stop"))
    await read_all(busy)
    second = await asyncio.wait_for(waiting, 10)
    assert second.provider_id == "b"
    assert pool.sent() == {"a": 0, "b": 2}


async def test_a_pinned_run_that_fails_does_not_fail_over_to_another_provider() -> None:
    pool = Pool()
    run = await pool.dispatcher.open_run(spec("b"))
    reader = asyncio.create_task(read_all(run))
    pool.deliver("b", Failed(ErrorCode.PROVIDER_UNAVAILABLE, "connection refused"))
    events = await asyncio.wait_for(reader, 10)
    assert isinstance(events[-1], Failed)
    assert pool.sent() == {"a": 0, "b": 1}  # unpinned, it would have gone to a


@pytest.mark.parametrize("pin", ["c", "node-a/b"])
async def test_a_pin_the_model_does_not_have_is_a_400(pin: str) -> None:
    pool = Pool()
    with pytest.raises(InvalidRequest, match="does not serve the model"):
        pool.dispatcher.admit(spec(pin))
    assert pool.sent() == {"a": 0, "b": 0}


def test_pinned_out_names_every_other_provider() -> None:
    class Member:
        def __init__(self, provider_id: str, node_id: str) -> None:
            self.provider_id, self.node_id = provider_id, node_id

    members = [Member("a", "n1"), Member("b", "n2"), Member("c", "n1")]
    assert pinned_out("b", members) == {"a", "c"}
    assert pinned_out("n1/c", members) == {"a", "b"}
    with pytest.raises(PinUnknown):
        pinned_out("n2/c", members)


def provider_pin(key: ApiKeyEntry | None, headers: dict[str, str]) -> str:
    """The pin the request's routing hints set ("": none)."""
    pin: str = routing_hints(key, headers, {}, {}).get("pin", "")
    return pin


def test_the_header_is_an_operator_s() -> None:
    header = {"x-iop-provider": " node-b/b "}
    assert provider_pin(OPS, header) == "node-b/b"
    assert provider_pin(None, header) == "node-b/b"  # the open API is the operator's
    assert provider_pin(ALICE, {}) == ""
    with pytest.raises(OperatorOnly):
        provider_pin(ALICE, header)
    for bad in ("", "n/", "a/b/c"):
        with pytest.raises(InvalidRequest):
            provider_pin(OPS, {"x-iop-provider": bad})
