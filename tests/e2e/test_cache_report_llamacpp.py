"""The cache a node reports, end to end on a real llama.cpp (xllamacpp + SmolLM2-135M):
two turns of one conversation go edge -> node -> llama.cpp, and the provider's slot at
the edge (``ProviderSlot.cache``) names the prefix llama.cpp served, with the prompt
tokens it took from its cache.

Everything on the path is the real code: the edge's node listener, registry and
dispatcher (in this process, with the control-plane's vouching for the node's token
answered by a stand-in), the node built by its own ``bootstrap.build`` over mTLS, and a
llama.cpp server in a child process with two slots. The model's text is never checked,
only what the engine says about its cache and what the node made of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from prometheus_client import CollectorRegistry

from iop_edge.adapters.node_server import NodeServer
from iop_edge.adapters.peer_guard import PeerGuard
from iop_edge.domain.events import Completed, Failed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.pool import AVAILABLE, ProviderSlot
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import WiredDispatcher
from iop_node.bootstrap import build
from iop_node.settings import NodeSettings
from iop_node.testing import llamacpp_child, llamacpp_missing
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.prefix import body_blocks, longest_match
from iop_proto.service import AdminServer
from iop_proto.testing import write_identity
from iop_proto.tls import TlsSettings, server_context
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"
PROVIDER = "node-a-llamacpp"
TOKEN = "iopnt_cache-test"
WAIT_S = 30.0


# About 1,400 characters (five blocks) before the conversation: an agent's system prompt.
SYSTEM = (
    "You are a terse assistant for a build system. Answer in one short sentence. "
    "Never use lists. Prefer exact file names. "
) * 12
FIRST: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which file holds the settings of the node?"},
    ],
    "max_tokens": 8,
    "temperature": 0,
}
SECOND: dict[str, Any] = {
    **FIRST,
    "messages": [
        *FIRST["messages"],
        {"role": "assistant", "content": "settings.py holds them."},
        {"role": "user", "content": "And the one of the edge?"},
    ],
}


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a llama.cpp server with SmolLM2-135M, 2 slots, 1 thread."""
    if (missing := llamacpp_missing()) is not None:
        pytest.skip(missing)
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    with llamacpp_child(log, alias=MODEL, ctx=4096, slots=2) as url:
        yield url


@dataclass
class Vouching:
    """The control-plane's answer to the node's registration: its token is good, and
    this is its config (one llama.cpp provider)."""

    config: pb.NodeConfig

    async def authorize(
        self, node_id: str, token: str, certificate_identity: str
    ) -> pb.AuthorizeNodeResponse:
        accepted = (node_id, token, certificate_identity) == ("node-a", TOKEN, "node-a")
        return pb.AuthorizeNodeResponse(accepted=accepted, token_id="t1", node_config=self.config)


class Dispatcher(WiredDispatcher):
    """The edge's dispatcher, which also says when the registry applied a snapshot."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        super().__init__(metrics)
        self.snapshot = asyncio.Event()

    def slots_changed(self, model_ids: Iterable[str]) -> None:
        super().slots_changed(model_ids)
        self.snapshot.set()


@dataclass
class Stack:
    dispatcher: Dispatcher
    slot: ProviderSlot

    async def complete(self, body: dict[str, Any]) -> Completed:
        spec = RunSpec(MODEL, Operation.CHAT_COMPLETIONS, body, stream=False, include_usage=True)
        run = await self.dispatcher.open_run(spec)
        async with asyncio.timeout(WAIT_S):
            while batch := await run.next_events():
                for event in batch:
                    if isinstance(event, Failed):
                        raise AssertionError(f"the run failed: {event}")
                    if isinstance(event, Completed):
                        return event
        raise AssertionError("the run ended without its terminal event")

    async def until(self, check: Any, what: str) -> None:
        """Until the slot passes ``check`` (after a snapshot), failing after ``WAIT_S``."""
        try:
            async with asyncio.timeout(WAIT_S):
                while not check(self.slot):
                    self.dispatcher.snapshot.clear()
                    await self.dispatcher.snapshot.wait()
        except TimeoutError:
            raise AssertionError(f"the slot never {what}: {self.slot.cache}") from None


def tls_of(ca: trustme.CA, directory: Path, name: str, role: str) -> TlsSettings:
    return write_identity(ca, directory / name, name, role)


@pytest.fixture
async def stack(llamacpp: str, tmp_path: Path) -> AsyncIterator[Stack]:
    ca = trustme.CA()
    edge_tls = tls_of(ca, tmp_path, "edge", "edge")
    node_tls = tls_of(ca, tmp_path, "node-a", "node")
    metrics = EdgeMetrics.create(CollectorRegistry())
    dispatcher = Dispatcher(metrics)
    entry = ProviderEntry(
        id=PROVIDER,
        node_id="node-a",
        type="llamacpp",
        category="local_inference",
        models=(MODEL,),
        capacity=2,
        max_queue=4,
        queue_timeout_ms=30_000,
        request_timeout_ms=60_000,
    )
    dispatcher.pool.apply_fleet(
        Fleet(
            version=1,
            models={MODEL: ModelEntry(MODEL, MODEL, {PROVIDER: MODEL})},
            providers={PROVIDER: entry},
        )
    )
    provider = pb.ProviderConfig(
        id=PROVIDER,
        type="llamacpp",
        category=pb.PROVIDER_CATEGORY_LOCAL_INFERENCE,
        models=[MODEL],
        capacity=2,
        max_queue=4,
        queue_timeout_ms=30_000,
        request_timeout_ms=60_000,
        settings_json=f'{{"endpoint": "{llamacpp}"}}'.encode(),
    )
    nodes = NodeServer(
        host="127.0.0.1",
        port=0,
        edge_id="edge",
        registry=dispatcher.pool,
        authorizer=Vouching(pb.NodeConfig(node_id="node-a", providers=[provider])),
        guard=PeerGuard(dispatcher, dispatcher.pool, metrics, None),
        metrics=metrics,
        tls=server_context(edge_tls),
        heartbeat_interval_s=5.0,
        max_frame_size=DEFAULT_MAX_FRAME_SIZE,
        register_timeout_s=10.0,
        handshake_timeout_s=10.0,
    )
    port = await nodes.start()
    settings = NodeSettings.model_validate(
        {
            "service_id": "node-a",
            "tls": node_tls.model_dump(),
            "edge": {"host": "127.0.0.1", "port": port, "server_name": "localhost"},
            "token": TOKEN,
            "history_db": str(tmp_path / "history.db"),
            "probes": {"interval_s": 1.0},
        }
    )
    registry = CollectorRegistry()
    admin = AdminServer("node", registry, host="127.0.0.1", port=0)
    try:
        async with build(settings, registry, admin):
            slot = dispatcher.pool.slot(PROVIDER)
            assert slot is not None
            ready = Stack(dispatcher, slot)
            await ready.until(lambda s: s.connected and s.health == AVAILABLE, "became available")
            yield ready
    finally:
        await nodes.aclose()


@pytest.mark.timeout(180)
async def test_the_edge_holds_the_prefix_llamacpp_served_and_its_cached_tokens(
    stack: Stack,
) -> None:
    first_chain, second_chain = body_blocks(FIRST), body_blocks(SECOND)
    assert len(first_chain) >= 5
    assert second_chain[: len(first_chain)] == first_chain  # the second turn extends the first

    first = await stack.complete(FIRST)
    assert first.usage is not None
    await stack.until(lambda s: s.cache.held, "heard of the first prompt")
    report = stack.slot.cache
    assert report.held == {first_chain[-1]: len(first_chain)}
    assert report.prompt_tokens == first.usage.prompt_tokens
    assert report.prefill_ms_per_token is not None  # llama.cpp's timings came through
    assert report.prefill_ms_per_token > 0

    second = await stack.complete(SECOND)
    assert second.usage is not None
    await stack.until(lambda s: second_chain[-1] in s.cache.held, "heard of the second prompt")
    report = stack.slot.cache
    # the longer prompt of the same conversation replaced the shorter: one place of the bound
    assert report.held == {second_chain[-1]: len(second_chain)}
    assert report.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    # llama.cpp served the second turn's shared part from its cache (the same slot held it)
    assert 0 < report.cached_tokens < second.usage.prompt_tokens
    assert report.hit_rate is not None
    assert report.hit_rate > 0

    # The edge hashes the conversation's next turn as the node did: selection finds it here.
    third = {**SECOND, "messages": [*SECOND["messages"], {"role": "assistant", "content": "x"}]}
    assert longest_match(body_blocks(third), report.held) == len(second_chain)
