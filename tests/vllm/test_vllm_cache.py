"""The node's cache report from a real vLLM: two prompts with one long prefix, and the
provider's ``CacheState`` counts the prompt tokens vLLM's prefix cache served.

vLLM 0.32 caches prefixes by default, but puts ``usage.prompt_tokens_details.cached_tokens``
in its answers only when started with ``--enable-prompt-tokens-details``, which
``tools/vllm_server.py`` passes; without it this test fails (the node would report 0).
The node here is ``NodeCore`` with the adapters ``bootstrap`` registers, fed run requests
as the edge link feeds them (converted by ``wire.run_order``), and read as the edge link
reads it (``wire.provider_state``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from iop_node.adapters.provider_http import ProviderHttp
from iop_node.bootstrap import ADAPTERS
from iop_node.domain.events import Failed, Started
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta
from iop_node.entrypoints import wire
from iop_node.metrics import NodeMetrics
from iop_node.ports import AdapterContext
from iop_node.service.providers import NodeCore, ProbeSettings
from iop_node.testing import NoHistory
from iop_proto.prefix import body_blocks
from iop_proto.v1 import runtime_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(420)]

PROVIDER = "node-vllm"
# vLLM caches whole blocks (128 tokens on the CPU): some 300 tokens of shared system prompt.
SYSTEM = "You answer questions about a build system in one sentence, naming files. " * 20


@dataclass
class Channel:
    """One run's terminal event, as the edge link's channel would send it."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    completion: Completion | None = None
    failure: str = ""
    first_token_ms: int = 0

    def started(self, event: Started) -> None:
        pass

    async def delta(self, delta: Delta) -> None:
        pass

    async def completed(self, completion: Completion) -> None:
        self.completion = completion
        self.ended.set()

    async def failed(self, failure: Failed) -> None:
        self.failure = failure.message
        self.ended.set()


@pytest.fixture
async def node(vllm_server: Any) -> AsyncIterator[NodeCore]:
    engines = ProviderHttp()
    async with aiohttp.ClientSession() as http:
        core = NodeCore(
            "node-a",
            ADAPTERS,
            AdapterContext(http, {}, engines=engines),
            NoHistory(),
            NodeMetrics.create(CollectorRegistry()),
            ProbeSettings(interval_s=60),
        )
        config = ProviderConfig(
            id=PROVIDER,
            type="vllm",
            models=(vllm_server.served,),
            capacity=4,
            settings={"endpoint": vllm_server.url},
        )
        await core.apply_config([config])
        try:
            yield core
        finally:
            await core.aclose()
            await engines.aclose()
    await vllm_server.wait_idle()


async def serve(core: NodeCore, run_id: str, body: dict[str, Any], stream: bool) -> Completion:
    request = pb.RunRequest(
        run_id=run_id,
        model="smollm2:135m",
        provider_id=PROVIDER,
        adapter="vllm",
        target=body["model"],
        operation=pb.OPERATION_CHAT_COMPLETIONS,
        body_json=json.dumps(body).encode(),
        stream=stream,
        include_usage=True,
    )
    channel = Channel()
    assert core.start_run(wire.run_order(request), channel)  # converted as the link does
    async with asyncio.timeout(120):
        await channel.ended.wait()
    assert channel.completion is not None, channel.failure
    return channel.completion


def question(served: str, text: str) -> dict[str, Any]:
    return {
        "model": served,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
    }


async def test_the_node_reports_the_tokens_vllms_prefix_cache_served(
    node: NodeCore, vllm_server: Any
) -> None:
    # questions longer than a block (256 characters), so the two prompts part in a whole one
    first = question(vllm_server.served, "Where are the node's settings? " * 10)
    second = question(vllm_server.served, "Where are the edge's settings? " * 10)
    one = await serve(node, "r1", first, stream=False)
    two = await serve(node, "r2", second, stream=True)  # streamed: the last chunk's usage
    assert one.usage is not None
    assert two.usage is not None
    # The shared system prompt came from the cache the second time (whole blocks of it).
    assert 0 < two.usage.cached_tokens < two.usage.prompt_tokens

    (status,) = node.states()
    state = wire.provider_state(status).cache
    assert state.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    assert state.cached_tokens == one.usage.cached_tokens + two.usage.cached_tokens
    assert state.cached_tokens >= two.usage.cached_tokens > 0
    # Both prompts are named, the newest first (they share a prefix, neither extends the other).
    tails = [(p.tail, p.blocks) for p in state.prefixes]
    first_chain, second_chain = body_blocks(first), body_blocks(second)
    assert first_chain[-1] not in second_chain  # the premise: the second does not extend it
    assert tails == [(second_chain[-1], len(second_chain)), (first_chain[-1], len(first_chain))]
    # vLLM gives no prefill timings: the rate stays unknown (0 on the wire).
    assert state.prefill_ms_per_token == 0
