"""What a node tells of a provider's engine for qualification reports
(docs/ARCHITECTURE.md#qualification-reports): the version where the engine says it
(vLLM's ``/version``, llama.cpp's ``/props`` build), nothing where it does not answer,
and the device (the engine's word, else this host's CPU, named as the host's)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop_node.adapters import openai_compat
from iop_node.adapters.mock import MockAdapter
from iop_node.adapters.ollama import OllamaAdapter
from iop_node.adapters.provider_http import ProviderHttp
from iop_node.domain.provider import ProviderConfig
from iop_node.ports import AdapterContext, EngineInfo
from iop_node.service.engine_probe import describe, host_cpu
from iop_proto.framing import DEFAULT_MAX_ANSWER_BYTES


@pytest.fixture
async def engine_url() -> AsyncIterator[str]:
    """A server that answers like vLLM's /version and llama.cpp's /props."""

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.1"})

    async def props(_: web.Request) -> web.Response:
        return web.json_response({"build_info": "b6713-abc1234", "total_slots": 1})

    async def ollama_version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.12.3"})

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/props", props)
    app.router.add_get("/api/version", ollama_version)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def engine_of(provider_type: str, endpoint: str) -> EngineInfo:
    engines = ProviderHttp()
    try:
        async with aiohttp.ClientSession() as session:
            config = ProviderConfig(id="p1", type=provider_type, settings={"endpoint": endpoint})
            context = AdapterContext(session, {}, DEFAULT_MAX_ANSWER_BYTES, engines=engines)
            adapter: Any = openai_compat.factory(provider_type)(config, context)
            return await describe(adapter, provider_type)
    finally:
        await engines.aclose()


async def test_vllm_and_llamacpp_say_their_versions(engine_url: str) -> None:
    vllm = await engine_of("vllm", engine_url)
    assert (vllm.name, vllm.version) == ("vllm", "0.32.1")
    llamacpp = await engine_of("llamacpp", engine_url + "/v1")
    assert (llamacpp.name, llamacpp.version) == ("llamacpp", "b6713-abc1234")
    # neither names a device: this host's CPU, said to be the node host's
    assert vllm.device == llamacpp.device == f"node host CPU: {host_cpu()}"
    assert host_cpu().endswith(" cores)")


async def test_an_engine_that_does_not_say_leaves_the_version_empty(engine_url: str) -> None:
    assert (await engine_of("openai_api", engine_url)).version == ""  # no version path
    refused = await engine_of("vllm", engine_url + "/nothing-here")  # 404
    assert (refused.name, refused.version) == ("vllm", "")
    gone = await engine_of("vllm", "http://127.0.0.1:9")  # nobody listens (discard port)
    assert gone.version == ""


async def test_ollama_says_its_version(engine_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        config = ProviderConfig(id="o", type="ollama", settings={"endpoint": engine_url})
        ollama = OllamaAdapter(config, AdapterContext(http=session, environ={}))
        info = await describe(ollama, "ollama")
        assert (info.name, info.version) == ("ollama", "0.12.3")
        gone = ProviderConfig(id="o", type="ollama", settings={"endpoint": "http://127.0.0.1:9"})
        silent = OllamaAdapter(gone, AdapterContext(http=session, environ={}))
        assert (await describe(silent, "ollama")).version == ""


async def test_the_mock_names_itself_and_no_device() -> None:
    async with aiohttp.ClientSession() as session:
        config = ProviderConfig(id="m", type="mock", models=("a",))
        mock = MockAdapter(config, AdapterContext(session, {}, DEFAULT_MAX_ANSWER_BYTES))
        info = await describe(mock, "mock")
    assert info.name == "iop-mock"
    assert info.version
    assert info.device == "none (simulated)"
