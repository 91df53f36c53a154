"""``POST /v1/responses/compact`` and the Responses WebSocket mode on the real llama.cpp
model (xllamacpp + SmolLM2-135M, started as the node's integration tests start it),
behind a real edge, control-plane and node. SmolLM2's text varies: shapes, statuses,
usage and the event order are checked, never content.
"""

from __future__ import annotations

import base64
import importlib.util
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from iop_node.testing import llamacpp_child, llamacpp_missing

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = "smollm2:135m"
PROVIDER = "node-a-llamacpp"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"iop_e2e_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


websocket = _load("test_responses_websocket", HERE / "test_responses_websocket.py")
contract = websocket.contract


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A llama.cpp server with SmolLM2-135M, 2 slots, 1 thread, for this module."""
    if (missing := llamacpp_missing()) is not None:
        pytest.skip(missing)
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    with llamacpp_child(log, alias=MODEL, slots=2) as url:
        yield url


def fleet(endpoint: str) -> dict[str, object]:
    llama = {
        "id": PROVIDER,
        "type": "llamacpp",
        "category": "local_inference",
        "endpoint": endpoint,
        "models": [MODEL],
        "capacity": 2,
        "max_queue": 4,
        "request_timeout_ms": 120_000,
    }
    return {
        "models": [{"id": MODEL, "providers": {PROVIDER: MODEL}}],
        "nodes": [{"id": "node-a", "providers": [llama]}, {"id": "node-b", "providers": []}],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, llamacpp: str
) -> AsyncIterator[Any]:
    async with start_stack_factory(tmp_path_factory.mktemp("llama"), fleet(llamacpp)) as running:
        await running.wait_registered(["node-a"])
        yield running


async def test_compact_on_llamacpp(stack: Any) -> None:
    conversation = [
        {"role": "user", "content": "My name is Ada and I am fixing a bug in parser.py."},
        {"role": "assistant", "content": "Which function fails?"},
        {"role": "user", "content": "The function read_header raises KeyError."},
    ]
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "input": conversation, "max_output_tokens": 48}
        async with http.post(f"{stack.api_url}/responses/compact", json=body) as reply:
            answer = await reply.json()
            assert reply.status == 200, answer
        assert answer["object"] == "response.compaction"
        *kept, item = answer["output"]
        assert [m["role"] for m in kept] == ["user", "user"]
        assert item["type"] == "compaction"
        summary = base64.b64decode(
            item["encrypted_content"].removeprefix("iop-compaction-v1:")
        ).decode()
        assert summary.strip()
        assert 0 < answer["usage"]["output_tokens"] <= 48
        assert answer["usage"]["input_tokens"] > 50  # the summarising prompt and transcript
        follow_body = {
            "model": MODEL,
            "input": [*answer["output"], {"role": "user", "content": "What is my name?"}],
            "max_output_tokens": 8,
        }
        async with http.post(f"{stack.api_url}/responses", json=follow_body) as reply:
            follow = await reply.json()
            assert reply.status == 200, follow
        contract.check_response(follow)
        assert follow["status"] in {"completed", "incomplete"}


async def test_websocket_mode_on_llamacpp(stack: Any) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{stack.api_url}/responses") as ws:
            first = await websocket.create(
                ws, model=MODEL, input="Say hello.", store=False, max_output_tokens=8
            )
            contract.check_events(first)
            final = first[-1]["response"]
            second = await websocket.create(
                ws,
                model=MODEL,
                input="Again.",
                previous_response_id=final["id"],
                store=False,
                max_output_tokens=8,
            )
            contract.check_events(second)
            later = second[-1]["response"]
            assert later["usage"]["input_tokens"] > final["usage"]["input_tokens"]
