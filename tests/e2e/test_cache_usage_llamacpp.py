"""Cached prompt tokens reach the client, on the real llama.cpp model (SmolLM2-135M),
through ``make run``'s stack (``test_local_stack``'s ``local_stack``).

llama.cpp keeps a slot's last prompt (``cache_prompt``, on by default) and says how much
of the next one it took from it (``timings.cache_n``; newer builds also
``usage.prompt_tokens_details.cached_tokens``). Two requests that share a long system
prompt: the second's usage shows tokens served from the cache, in each API's words:
OpenAI's ``prompt_tokens_details.cached_tokens``, Anthropic's ``cache_read_input_tokens``
(with ``input_tokens`` the rest), Responses' ``input_tokens_details.cached_tokens``;
streamed and not, and over the Responses WebSocket. The run log keeps the count.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"iop_e2e_{name}", HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


local = _load("test_local_stack")
certs = local.certs  # the fixture, under this module's name
LLAMA = local.LLAMA_MODEL
ANTHROPIC = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
ENDS = ("response.completed", "response.incomplete", "response.failed")

# Well past 600 characters (about 150 tokens): the shared prefix the second request finds.
SYSTEM = (
    "You are the release assistant of a small open-source project. You answer questions "
    "about the changelog, the supported platforms and the upgrade steps. Keep answers "
    "short, factual and polite. When you do not know something, say so plainly and name "
    "the document that would tell. Never invent version numbers, dates or names. The "
    "project ships a server, a command-line client and a web console; the server runs on "
    "Linux and macOS, the client everywhere Python 3.11 runs, and the console in any "
    "current browser. Upgrades go one minor version at a time: read the notes, back up "
    "the state directory, stop the server, install the new version, start it, and check "
    "the health endpoint before sending traffic again. Security fixes are backported to "
    "the two newest minor versions only; older ones should upgrade. "
) * 2


def _sse_data(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (``[DONE]`` and comments skipped)."""
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> Any:
    async with http.post(url, json=body, **kw) as response:
        assert response.status == 200, await response.text()
        if body.get("stream"):
            return _sse_data(await response.text())
        return await response.json()


def chat(question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": LLAMA, "messages": messages, "max_tokens": 4, **extra}


async def check_openai_chat(http: aiohttp.ClientSession, api: str) -> None:
    url = f"{api}/chat/completions"
    first = await _post(http, url, chat("Which platforms?"))
    assert first["usage"]["prompt_tokens"] > 100
    again = await _post(http, url, chat("Which platforms?"))
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 100 < cached <= again["usage"]["prompt_tokens"], again["usage"]
    streamed = await _post(
        http, url, chat("How to upgrade?", stream=True, stream_options={"include_usage": True})
    )
    usage = streamed[-1]["usage"]
    assert 100 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"], usage


async def check_anthropic_messages(http: aiohttp.ClientSession, api: str) -> None:
    url = f"{api}/messages"
    body = {
        "model": LLAMA,
        "system": SYSTEM,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Which fixes are backported?"}],
    }
    await _post(http, url, body, headers=ANTHROPIC)
    message = await _post(http, url, body, headers=ANTHROPIC)
    usage = message["usage"]
    assert usage["cache_read_input_tokens"] > 100, usage
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] >= 0
    events = await _post(
        http,
        url,
        {**body, "stream": True, "messages": [{"role": "user", "content": "Why?"}]},
        headers=ANTHROPIC,
    )
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["usage"]["cache_read_input_tokens"] > 100, delta
    assert delta["usage"]["input_tokens"] > 0  # the new question was not in the cache


async def check_responses(http: aiohttp.ClientSession, api: str) -> None:
    url = f"{api}/responses"
    body = {"model": LLAMA, "instructions": SYSTEM, "input": "Name the parts.",
            "max_output_tokens": 16}  # fmt: skip
    await _post(http, url, body)
    response = await _post(http, url, body)
    usage = response["usage"]
    assert 100 < usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"], usage
    events = await _post(http, url, {**body, "stream": True, "input": "Which browsers?"})
    # 16 tokens may end it "incomplete" (max_output_tokens): its usage is the same
    (end,) = [e for e in events if e["type"] in ENDS]
    usage = end["response"]["usage"]
    assert 100 < usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"], usage


async def check_responses_websocket(http: aiohttp.ClientSession, api: str) -> None:
    """WebSocket mode writes the same events (``ResponseEventStream``) as text frames."""
    body = {"type": "response.create", "model": LLAMA, "instructions": SYSTEM,
            "input": "Which client?", "max_output_tokens": 16, "store": False}  # fmt: skip
    async with http.ws_connect(f"{api}/responses") as ws:
        await ws.send_json(body)
        async with asyncio.timeout(60):
            while (event := json.loads((await ws.receive()).data))["type"] not in ENDS:
                assert event["type"] != "error", event
    usage = event["response"]["usage"]
    assert 100 < usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"], usage


async def check_run_log(http: aiohttp.ClientSession, api: str) -> None:
    origin = api.removesuffix("/v1")
    async with http.get(f"{origin}/iop/v1/runs", params={"limit": "20"}) as response:
        assert response.status == 200
        runs = (await response.json())["data"]
    served = [r for r in runs if r["model"] == LLAMA and r["outcome"] == "completed"]
    assert served, runs
    assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in served)
    assert sum(r["cached_tokens"] > 100 for r in served) >= 6, served


@pytest.mark.timeout(300)
async def test_cached_prompt_tokens_reach_every_api_on_llamacpp(
    tmp_path: Path, certs: Path
) -> None:
    if (reason := local.missing_llamacpp()) is not None:
        pytest.skip(f"the real llama.cpp provider cannot run: {reason}")
    async with local.local_stack(tmp_path, certs) as (running, up):
        async with aiohttp.ClientSession() as http:
            await check_openai_chat(http, up["api"])
            await check_anthropic_messages(http, up["api"])
            await check_responses(http, up["api"])
            await check_responses_websocket(http, up["api"])
            await check_run_log(http, up["api"])
        assert await running.stop() == 0, running.output
