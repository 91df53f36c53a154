"""The ``llamaswap`` adapter reports what llama-swap holds in memory
(docs/ARCHITECTURE.md#warm-aware-scheduling), against a server on 127.0.0.1 that answers
as llama-swap does: ``/v1/models``, ``/v1/chat/completions`` and ``/running``, starting a
model's server at its first request and stopping the other one (one at a time)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop_node.adapters.llamaswap import LlamaSwapAdapter
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
DEADLINE_S = 30.0


class FakeLlamaSwap:
    """Two configured models, one running at a time. A request for a model that is not
    running stops the running one and starts it: ``starting`` until ``loaded`` is set
    (the load's delay, held by the test), then ``ready``. ``/running`` lists the ready
    ones, as llama-swap does now; ``every_state``: every process with its state, as
    older versions did."""

    def __init__(self) -> None:
        self.running: dict[str, str] = {}  # model -> state
        self.loaded = asyncio.Event()
        self.starting = asyncio.Event()
        self.running_status = 200
        self.every_state = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/running", self._running)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _models(self, _: web.Request) -> web.Response:
        data = [{"id": "qwen", "object": "model"}, {"id": "smollm", "object": "model"}]
        return web.json_response({"object": "list", "data": data})

    async def _running(self, _: web.Request) -> web.Response:
        if self.running_status != 200:
            return web.Response(status=self.running_status, text="404 page not found")
        rows: list[dict[str, Any]] = [
            {"model": name, "state": state, "cmd": "llama-server --port 5800", "ttl": 0}
            for name, state in self.running.items()
            if self.every_state or state == "ready"
        ]
        return web.json_response({"running": rows})

    async def _chat(self, request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        if self.running.get(model) != "ready":
            self.running = {model: "starting"}  # swapped: the other one is stopped
            self.starting.set()
            await self.loaded.wait()
            self.running[model] = "ready"
        return web.json_response({**CHAT, "model": model})


@pytest.fixture
async def swap() -> AsyncIterator[tuple[FakeLlamaSwap, LlamaSwapAdapter]]:
    fake = FakeLlamaSwap()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engines = ProviderHttp()
    try:
        async with aiohttp.ClientSession() as session:
            config = ProviderConfig(
                id="s1",
                type="llamaswap",
                settings={"endpoint": f"http://127.0.0.1:{port}/v1", "max_loaded_models": 1},
            )
            context = AdapterContext(session, {}, engines=engines)
            yield fake, LlamaSwapAdapter(config, context)
    finally:
        fake.loaded.set()  # no request is left waiting on a load
        await engines.aclose()
        await runner.cleanup()


def chat_spec(model: str) -> ExecutionSpec:
    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    return ExecutionSpec(
        run_id="r1",
        model="public",
        provider_id="s1",
        adapter="llamaswap",
        target=model,
        operation=Operation.CHAT_COMPLETIONS,
        body_json=json_codec.dumps(body),
        stream=False,
        include_usage=False,
        deadline=asyncio.get_running_loop().time() + DEADLINE_S,
    )


def held(adapter: LlamaSwapAdapter) -> list[str]:
    return [m.name for m in adapter.load_state().models]


@pytest.mark.parametrize("every_state", [False, True], ids=["ready-only", "older-every-state"])
async def test_the_probe_reads_what_llama_swap_runs_and_a_starting_model_is_cold(
    swap: tuple[FakeLlamaSwap, LlamaSwapAdapter], every_state: bool
) -> None:
    fake, adapter = swap
    fake.every_state = every_state
    assert isinstance(adapter, LoadReporter)
    assert (await adapter.probe()).models == ("qwen", "smollm")
    assert held(adapter) == []  # nothing runs until a request asks for it
    assert adapter.load_state().max_loaded == 1  # the fleet's max_loaded_models

    fake.loaded.set()
    completion = await adapter.execute(chat_spec("qwen"), RecordingSink())
    assert completion.result is not None
    assert held(adapter) == ["qwen"]  # from the answer, before a probe
    assert (await adapter.probe()).ok
    assert held(adapter) == ["qwen"]  # llama-swap says so too

    # A request for the other model swaps: while it loads, neither is warm.
    fake.loaded.clear()
    fake.starting.clear()
    run = asyncio.create_task(adapter.execute(chat_spec("smollm"), RecordingSink()))
    async with asyncio.timeout(DEADLINE_S):
        await fake.starting.wait()
    assert (await adapter.probe()).ok
    assert held(adapter) == []  # qwen stopped, smollm still starting
    fake.loaded.set()
    async with asyncio.timeout(DEADLINE_S):
        await run
    assert held(adapter) == ["smollm"]
    assert (await adapter.probe()).ok
    state = adapter.load_state()
    assert [m.name for m in state.models] == ["smollm"]
    assert state.timings == ()  # llama-swap reports no load times: warm/cold only


async def test_a_proxy_without_running_keeps_what_the_answers_said(
    swap: tuple[FakeLlamaSwap, LlamaSwapAdapter],
) -> None:
    fake, adapter = swap
    fake.running_status = 404
    fake.loaded.set()
    await adapter.execute(chat_spec("smollm"), RecordingSink())
    assert (await adapter.probe()).ok  # the model list answered: the provider is up
    assert held(adapter) == ["smollm"]


def test_the_node_registers_the_type() -> None:
    from iop_node.bootstrap import ADAPTERS  # the registry the node builds providers from

    assert ADAPTERS["llamaswap"] is LlamaSwapAdapter
