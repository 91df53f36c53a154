"""The ``lemonade`` adapter reports what Lemonade Server holds in memory
(docs/ARCHITECTURE.md#warm-aware-scheduling), against a server on 127.0.0.1 that answers
as Lemonade's documented ``/api/v1`` does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop_node.adapters.lemonade import LemonadeAdapter
from iop_node.adapters.provider_http import ProviderHttp
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, Operation
from iop_node.ports import AdapterContext, LoadReporter
from iop_node.testing import RecordingSink
from iop_proto import json_codec

CHAT = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


class FakeLemonade:
    """Two installed models; ``loaded`` is what its health says it holds."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.health: dict[str, Any] | None = None  # None: the documented shape

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/models", self._models)
        app.router.add_get("/api/v1/health", self._health)
        app.router.add_post("/api/v1/chat/completions", self._chat)
        return app

    async def _models(self, _: web.Request) -> web.Response:
        data = [{"id": "Qwen3-0.6B-GGUF"}, {"id": "Llama-3.2-1B"}]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, _: web.Request) -> web.Response:
        if self.health is not None:
            return web.json_response(self.health)
        rows = [{"model_name": name, "type": "llm", "device": "cpu"} for name in self.loaded]
        return web.json_response(
            {
                "status": "ok",
                "model_loaded": self.loaded[-1] if self.loaded else None,
                "all_models_loaded": rows,
                "max_models": {"llm": 1, "embedding": 1, "reranking": 1},
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.loaded = [body["model"]]  # it holds one LLM: the other is unloaded
        return web.json_response(CHAT)


@pytest.fixture
async def lemonade() -> AsyncIterator[tuple[FakeLemonade, LemonadeAdapter]]:
    fake = FakeLemonade()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engines = ProviderHttp()
    try:
        async with aiohttp.ClientSession() as session:
            config = ProviderConfig(
                id="l1", type="lemonade", settings={"endpoint": f"http://127.0.0.1:{port}/api/v1"}
            )
            context = AdapterContext(session, {}, engines=engines)
            yield fake, LemonadeAdapter(config, context)
    finally:
        await engines.aclose()
        await runner.cleanup()


def chat_spec(model: str) -> ExecutionSpec:
    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    return ExecutionSpec(
        run_id="r1",
        model="public",
        provider_id="l1",
        adapter="lemonade",
        target=model,
        operation=Operation.CHAT_COMPLETIONS,
        body_json=json_codec.dumps(body),
        stream=False,
        include_usage=False,
        deadline=asyncio.get_running_loop().time() + 10,
    )


async def test_the_probe_reads_what_lemonade_holds_and_how_many(
    lemonade: tuple[FakeLemonade, LemonadeAdapter],
) -> None:
    fake, adapter = lemonade
    assert isinstance(adapter, LoadReporter)
    assert (await adapter.probe()).models == ("Qwen3-0.6B-GGUF", "Llama-3.2-1B")
    assert adapter.load_state().models == ()
    await adapter.execute(chat_spec("Llama-3.2-1B"), RecordingSink())
    assert [m.name for m in adapter.load_state().models] == ["Llama-3.2-1B"]  # before a probe
    fake.loaded = ["Qwen3-0.6B-GGUF"]  # another request swapped it
    assert (await adapter.probe()).ok
    state = adapter.load_state()
    assert [m.name for m in state.models] == ["Qwen3-0.6B-GGUF"]
    assert state.max_loaded == 1
    assert state.timings == ()  # Lemonade reports no load times


async def test_an_older_health_with_only_model_loaded_is_read_too(
    lemonade: tuple[FakeLemonade, LemonadeAdapter],
) -> None:
    fake, adapter = lemonade
    fake.health = {"status": "ok", "model_loaded": "Llama-3.2-1B"}
    assert (await adapter.probe()).ok
    state = adapter.load_state()
    assert [m.name for m in state.models] == ["Llama-3.2-1B"]
    assert state.max_loaded == 0
