"""Operations a provider does not offer (the fleet file's ``operations``, or a 501 it
answered): requests for them go only to the providers that offer them, a model none of
whose providers does refuses them up front, and the catalog shows what each offers. On
the real dispatcher and registry with fake node links."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, ErrorCode, Failed, Retrying, RunEvent, RunOrder
from iop_edge.domain.fleet import PUBLIC_OPERATIONS, Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.errors import UnsupportedOperation, from_failure
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.service.catalog import PoolCatalog
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_edge.testing import read_all
from iop_proto.v1 import runtime_pb2 as pb

MODEL = "m"
CHAT = frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS})
NO_EMBEDDINGS = Failed(
    ErrorCode.INVALID_REQUEST,
    "The model 'm' does not offer embeddings on this provider (HTTP 501: not supported)",
    provider_status=501,
)


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
        pass


def provider(pid: str, operations: frozenset[Operation] | None = None) -> ProviderEntry:
    entry = ProviderEntry(
        pid, f"node-{pid}", "mock", "api", (f"served-{pid}",), 2, 4, 5_000, 30_000
    )
    return entry if operations is None else replace(entry, operations=operations)


class Pool:
    """Providers on nodes of their own, all connected and available, all in model ``m``."""

    def __init__(self, *entries: ProviderEntry, retries: int = 2) -> None:
        self.dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()))
        self.fleet = Fleet(
            version=1,
            models={
                MODEL: ModelEntry(MODEL, MODEL, {e.id: e.id for e in entries}, retries=retries)
            },
            providers={e.id: e for e in entries},
        )
        self.dispatcher.pool.apply_fleet(self.fleet)
        self.nodes: dict[str, FakeNode] = {}
        for entry in entries:
            self.connect(entry.id)
        d = self.dispatcher
        self.catalog = PoolCatalog(d.fleet, d.pool, d)

    def connect(self, pid: str) -> None:
        node = self.nodes[pid] = FakeNode(f"node-{pid}")
        state = pb.ProviderState(provider_id=pid, health=pb.HEALTH_AVAILABLE)
        self.dispatcher.pool.node_connected(node, provider_reports([state]))

    def deliver(self, pid: str, *events: RunEvent) -> None:
        run_id = self.nodes[pid].sent[-1].run_id
        for event in events:
            run = self.dispatcher.runs.get(run_id)
            assert run is not None
            run.deliver(event)

    def provider_row(self, pid: str) -> dict[str, object]:
        return next(v for v in self.catalog.provider_views() if v["provider_id"] == pid)

    def model_operations(self) -> object:
        return self.catalog.model_views()[0]["operations"]


def spec(operation: Operation) -> RunSpec:
    body: dict[str, object] = {"model": MODEL, "input": "hi"}
    if operation is Operation.CHAT_COMPLETIONS:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return RunSpec(MODEL, operation, body, stream=False, include_usage=False)


async def test_a_request_goes_only_to_a_provider_that_offers_its_operation() -> None:
    pool = Pool(provider("chat", CHAT), provider("all"))
    for _ in range(2):  # "chat" is first and as free, yet never chosen for embeddings
        run = await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
        assert run.provider_id == "all"
    chat = await pool.dispatcher.open_run(spec(Operation.CHAT_COMPLETIONS))
    assert chat.provider_id == "chat"
    assert pool.nodes["chat"].sent[0].operation is Operation.CHAT_COMPLETIONS


async def test_an_embeddings_request_waits_for_a_provider_that_offers_it() -> None:
    pool = Pool(provider("chat", CHAT), provider("all"))
    busy = [await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS)) for _ in range(2)]
    waiting = asyncio.create_task(pool.dispatcher.open_run(spec(Operation.EMBEDDINGS)))
    await asyncio.sleep(0)
    assert pool.dispatcher.queued(MODEL) == 1  # "chat" is free, but it has no embeddings
    pool.deliver("all", Completed(finish_reason="stop"))
    assert (await waiting).provider_id == "all"
    assert [r.provider_id for r in busy] == ["all", "all"]


async def test_an_operation_no_provider_offers_is_refused_before_any_queue() -> None:
    pool = Pool(provider("a", CHAT), provider("b", CHAT))
    with pytest.raises(UnsupportedOperation) as refused:
        await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
    assert (refused.value.status, refused.value.code) == (400, "unsupported_operation")
    assert refused.value.message.startswith("The model 'm' does not offer embeddings")
    assert pool.nodes["a"].sent == pool.nodes["b"].sent == []
    assert pool.dispatcher.queued(MODEL) == 0
    assert [s.in_flight for s in pool.dispatcher.pool.slots()] == [0, 0]
    assert pool.model_operations() == ["chat_completions", "completions"]


async def test_a_501_fails_over_and_the_provider_is_not_chosen_for_it_again() -> None:
    pool = Pool(provider("llama"), provider("mock"))
    run = await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
    assert run.provider_id == "llama"
    reader = asyncio.create_task(read_all(run))
    pool.deliver("llama", NO_EMBEDDINGS)
    await pool.nodes["mock"].got_run.wait()
    pool.deliver("mock", Completed(finish_reason="stop"))
    assert [type(e) for e in await reader] == [Retrying, Completed]

    row = pool.provider_row("llama")
    assert row["operations"] == ["chat_completions", "completions"]
    assert row["refused_operations"] == ["embeddings"]
    assert pool.provider_row("mock")["refused_operations"] == []
    assert pool.model_operations() == ["chat_completions", "completions", "embeddings"]
    again = await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
    assert again.provider_id == "mock"  # "llama" is free and first, but refused it
    chat = await pool.dispatcher.open_run(spec(Operation.CHAT_COMPLETIONS))
    assert chat.provider_id == "llama"  # for what it offers, it is chosen as before


async def test_with_nobody_else_the_501_is_the_client_s_400_and_then_refused_up_front() -> None:
    pool = Pool(provider("llama"))
    run = await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
    reader = asyncio.create_task(read_all(run))
    pool.deliver("llama", NO_EMBEDDINGS)
    events = await reader
    assert events == [NO_EMBEDDINGS]
    error = from_failure(NO_EMBEDDINGS)
    assert (type(error), error.status, error.code) == (
        UnsupportedOperation,
        400,
        "unsupported_operation",
    )
    with pytest.raises(UnsupportedOperation):
        await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
    assert len(pool.nodes["llama"].sent) == 1


async def test_a_reconnected_node_or_a_new_fleet_is_tried_again() -> None:
    pool = Pool(provider("llama"))
    run = await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))
    reader = asyncio.create_task(read_all(run))
    pool.deliver("llama", NO_EMBEDDINGS)
    await reader
    assert pool.model_operations() == ["chat_completions", "completions"]
    pool.connect("llama")  # restarted, maybe with --embeddings now
    assert pool.provider_row("llama")["refused_operations"] == []
    assert (await pool.dispatcher.open_run(spec(Operation.EMBEDDINGS))).provider_id == "llama"
    pool.deliver("llama", NO_EMBEDDINGS)  # still not
    await asyncio.sleep(0)
    assert pool.provider_row("llama")["refused_operations"] == ["embeddings"]
    pool.dispatcher.pool.apply_fleet(replace(pool.fleet, version=2))
    assert pool.provider_row("llama")["refused_operations"] == []


def test_the_fleet_s_operations_reach_the_domain_with_the_type_s_default() -> None:
    config = pb.FleetConfig(
        version=3,
        nodes=[
            pb.NodeConfig(
                node_id="n",
                providers=[
                    pb.ProviderConfig(id="llama", type="llamacpp", operations=["chat_completions"]),
                    pb.ProviderConfig(id="old-cli", type="cli"),  # an older control-plane
                    pb.ProviderConfig(id="old-api", type="openai_api"),
                    pb.ProviderConfig(id="new", type="mock", operations=["embeddings", "images"]),
                ],
            )
        ],
    )
    providers = fleet_from_proto(config).providers
    # count_tokens: the edge's own, for the types with a tokenizer (llama.cpp, vLLM, mock)
    assert providers["llama"].operations == {Operation.CHAT_COMPLETIONS, Operation.COUNT_TOKENS}
    assert providers["old-cli"].operations == CHAT
    assert providers["old-api"].operations == frozenset(PUBLIC_OPERATIONS)
    assert providers["new"].operations == {  # a newer name: skipped
        Operation.EMBEDDINGS,
        Operation.COUNT_TOKENS,
    }


def count_spec() -> RunSpec:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return RunSpec(MODEL, Operation.COUNT_TOKENS, body, stream=False, include_usage=False)


async def test_count_tokens_takes_no_slot_and_waits_in_no_queue() -> None:
    """Every slot of the model is taken and a request waits: a count still goes at once
    (to the least loaded provider with a tokenizer), and ends without freeing a slot."""
    tokenizing = frozenset({*CHAT, Operation.COUNT_TOKENS})
    pool = Pool(provider("a", tokenizing), provider("b", CHAT))
    busy = [await pool.dispatcher.open_run(spec(Operation.CHAT_COMPLETIONS)) for _ in range(4)]
    waiting = asyncio.create_task(pool.dispatcher.open_run(spec(Operation.CHAT_COMPLETIONS)))
    await asyncio.sleep(0)
    assert pool.dispatcher.queued(MODEL) == 1
    counted = await pool.dispatcher.open_run(count_spec())
    assert counted.provider_id == "a"  # "b" has no tokenizer
    assert pool.nodes["a"].sent[-1].operation is Operation.COUNT_TOKENS
    slots = {s.provider_id: s for s in pool.dispatcher.pool.slots()}
    assert (slots["a"].own_in_flight, slots["b"].own_in_flight) == (2, 2)
    pool.deliver("a", Completed(finish_reason="", usage=None))
    assert (await read_all(counted))[-1] == Completed(finish_reason="", usage=None)
    assert (slots["a"].own_in_flight, slots["b"].own_in_flight) == (2, 2)  # nothing freed
    assert pool.dispatcher.queued(MODEL) == 1  # so the waiter still waits
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for run in busy:
        await run.cancel("done")
    assert pool.model_operations() == ["chat_completions", "completions"]  # public ones only
