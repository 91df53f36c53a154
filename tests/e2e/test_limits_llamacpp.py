"""The limits agents live with, on the real llama.cpp model (SmolLM2-135M, 8,192-token
context), through ``make run``'s stack (``test_local_stack``'s ``local_stack``):

- opencode's request asks ``max_tokens: 32000`` of every model: it runs, lowered to the
  model's cap, and the answer says so (``x-iop-max-tokens-clamped``);
- a prompt past the context is OpenAI's ``context_length_exceeded`` with llama.cpp's
  numbers, and Anthropic's "prompt is too long" on ``/v1/messages``;
- ``/v1/models`` tells the model's context window and output cap.
"""

from __future__ import annotations

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
CLAMPED = "x-iop-max-tokens-clamped"


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
WINDOW = 8192  # configs/fleet.yaml: smollm2's context_window, make run's llama.cpp --ctx
CAP = 512  # and its max_output_tokens

# opencode 1.18's first request of a session, as captured (its system prompt shortened).
OPENCODE_HEADERS = {
    "User-Agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14",
    "x-session-affinity": "ses_dc5423bf6ffeFsCOVtppcNhqu5",
    "x-session-id": "ses_dc5423bf6ffeFsCOVtppcNhqu5",
}
OPENCODE_BODY: dict[str, Any] = {
    "model": LLAMA,
    "max_tokens": 32000,
    "messages": [
        {
            "role": "system",
            "content": "You are a title generator. You output ONLY a thread title. Nothing "
            "else.\n\n<task>\nGenerate a brief title that would help the user find this "
            "conversation later.\n</task>",
        },
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": '"List the files in this directory"'},
    ],
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def check_opencodes_request_runs_clamped(http: aiohttp.ClientSession, api: str) -> None:
    body = {**OPENCODE_BODY, "max_tokens": 32000}
    async with http.post(f"{api}/chat/completions", json=body, headers=OPENCODE_HEADERS) as r:
        assert r.status == 200, await r.text()
        assert r.headers[CLAMPED] == f"32000->{CAP}"
        text = await r.text()
    chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert text.rstrip().endswith("data: [DONE]")
    usage = chunks[-1]["usage"]
    assert 0 < usage["completion_tokens"] <= CAP


async def check_overflow_is_context_length_exceeded(http: aiohttp.ClientSession, api: str) -> None:
    long = [{"role": "user", "content": "hello " * (WINDOW + 200)}]
    for stream in (False, True):
        body = {"model": LLAMA, "messages": long, "max_tokens": 8, "stream": stream}
        async with http.post(f"{api}/chat/completions", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "messages",
            "context_length_exceeded",
        )
        assert error["message"].startswith(
            f"This model's maximum context length is {WINDOW} tokens. However, your "
            "messages resulted in "
        )
    messages = {"model": LLAMA, "max_tokens": 32000, "messages": long}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
    async with http.post(f"{api}/messages", json=messages, headers=headers) as r:
        assert r.status == 400
        assert r.headers[CLAMPED] == f"32000->{CAP}"  # clamped first, then refused
        answer = await r.json()
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    message = answer["error"]["message"]
    assert message.startswith("prompt is too long: ")
    assert message.endswith(f" tokens > {WINDOW} maximum")


async def check_models_tell_their_limits(http: aiohttp.ClientSession, api: str) -> None:
    async with http.get(f"{api}/models/{LLAMA}") as r:
        assert r.status == 200
        model = await r.json()
    assert model["context_window"] == model["context_length"] == WINDOW
    assert model["max_output_tokens"] == model["max_output_length"] == CAP


@pytest.mark.timeout(240)
async def test_agents_limits_on_llamacpp(tmp_path: Path, certs: Path) -> None:
    if (reason := local.missing_llamacpp()) is not None:
        pytest.skip(f"the real llama.cpp provider cannot run: {reason}")
    async with local.local_stack(tmp_path, certs) as (running, up):
        async with aiohttp.ClientSession() as http:
            await check_models_tell_their_limits(http, up["api"])
            await check_opencodes_request_runs_clamped(http, up["api"])
            await check_overflow_is_context_length_exceeded(http, up["api"])
        assert await running.stop() == 0, running.output
