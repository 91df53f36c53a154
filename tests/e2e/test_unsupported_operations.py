"""Operations a provider does not offer, on a real stack with the official OpenAI SDK.

An OpenAI-compatible server on loopback stands in for llama.cpp started without
``--embeddings``: it lists its models, answers chat, and answers every embeddings
request with llama.cpp's 501. Three models on it and on mocks:
- ``pool``: that server (listed first: chosen first on ties) and a mock. Embeddings
  all succeed: the first one fails over from the 501 to the mock, and the edge stops
  choosing the server for embeddings (the catalog says so); chat still goes to it.
- ``solo``: that server alone, under another provider id. Embeddings are a 400
  ``unsupported_operation`` naming model and operation, which the SDK does not retry:
  the first from the 501 itself, the next refused by the edge before any provider.
- ``chat-only``: a mock whose fleet entry lists only ``chat_completions``: refused up
  front, and the catalog shows the operations from the fleet file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from openai import AsyncOpenAI

from iop_proto.testing import loopback_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALL = ["chat_completions", "completions", "embeddings"]
NO_EMBEDDINGS = ["chat_completions", "completions"]
# llama.cpp's answer to /v1/embeddings when started without --embeddings
LLAMA_501 = {
    "error": {
        "code": 501,
        "message": "This server does not support embeddings. Start it with `--embeddings`",
        "type": "not_supported_error",
    }
}


class NoEmbeddingsUpstream:
    """Chat yes, embeddings 501; counts the embeddings requests by served name."""

    def __init__(self) -> None:
        self.embeddings: Counter[str] = Counter()
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "pool-llama"}, {"id": "solo-llama"}]}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {
                "id": "chatcmpl-upstream",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hello from llama"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            }
        )

    async def _embeddings(self, request: web.Request) -> web.Response:
        self.embeddings[(await request.json())["model"]] += 1
        return web.json_response(LLAMA_501, status=501)


def fleet(port: int) -> dict[str, Any]:
    def llama(pid: str, served: str) -> dict[str, object]:
        return {
            "id": pid,
            "type": "llamacpp",
            "category": "local_inference",
            "endpoint": f"http://127.0.0.1:{port}",
            "models": [served],
            "capacity": 2,
        }

    def mock(pid: str, served: str, **extra: object) -> dict[str, object]:
        return {
            "id": pid,
            "type": "mock",
            "category": "local_inference",
            "models": [served],
            "capacity": 2,
            "tokens_per_second": 200,
            **extra,
        }

    return {
        "models": [
            {"id": "pool", "providers": {"node-b-llama": "pool-llama", "node-b-mock": "pool-mock"}},
            {"id": "solo", "providers": {"node-a-llama": "solo-llama"}},
            {"id": "chat-only", "providers": {"node-a-chat": "chat-only"}},
        ],
        "nodes": [
            {
                "id": "node-a",
                "providers": [
                    llama("node-a-llama", "solo-llama"),
                    mock("node-a-chat", "chat-only", operations=["chat_completions"]),
                ],
            },
            {
                "id": "node-b",
                "providers": [
                    llama("node-b-llama", "pool-llama"),
                    mock("node-b-mock", "pool-mock"),
                ],
            },
        ],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream() -> AsyncIterator[NoEmbeddingsUpstream]:
    server = NoEmbeddingsUpstream()
    async with loopback_app(server.app()) as port:
        server.port = port
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, upstream: Any
) -> AsyncIterator[Any]:
    root = Path(tmp_path_factory.mktemp("operations"))
    async with start_stack_factory(root, fleet(upstream.port)) as running:
        yield running


async def catalog(stack: Any, what: str) -> dict[str, dict[str, Any]]:
    url = stack.api_url.removesuffix("/v1") + f"/iop/v1/catalog/{what}"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200
        rows = (await response.json())["data"]
    key = "provider_id" if what == "providers" else "id"
    return {row[key]: row for row in rows}


async def test_the_catalog_shows_each_provider_s_and_model_s_operations(stack: Any) -> None:
    providers = await catalog(stack, "providers")
    assert {pid: row["operations"] for pid, row in providers.items()} == {
        "node-a-llama": ALL,  # its type's default: the fleet file does not say otherwise
        "node-a-chat": ["chat_completions"],
        "node-b-llama": ALL,
        "node-b-mock": ALL,
    }
    assert all(row["refused_operations"] == [] for row in providers.values())
    models = await catalog(stack, "models")
    assert models["chat-only"]["operations"] == ["chat_completions"]
    assert models["pool"]["operations"] == ALL


async def test_an_operation_declared_away_is_a_400_before_any_provider(stack: Any) -> None:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="unused") as sdk:  # SDK retries on
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.embeddings.create(model="chat-only", input="hello")
        assert refused.value.code == "unsupported_operation"
        assert "'chat-only' does not offer embeddings" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.completions.create(model="chat-only", prompt="hello", max_tokens=3)
        assert "'chat-only' does not offer completions" in refused.value.message
        answer = await sdk.chat.completions.create(
            model="chat-only", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content


async def test_embeddings_on_a_pool_all_succeed_on_the_provider_that_offers_them(
    stack: Any, upstream: NoEmbeddingsUpstream
) -> None:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0) as sdk:
        for _ in range(4):  # no SDK retry: each success is the edge's own doing
            result = await sdk.embeddings.create(model="pool", input=["hello", "world"])
            assert [e.index for e in result.data] == [0, 1]
            assert result.model == "pool"
        assert upstream.embeddings["pool-llama"] == 1  # tried once, then never again
        providers = await catalog(stack, "providers")
        assert providers["node-b-llama"]["operations"] == NO_EMBEDDINGS
        assert providers["node-b-llama"]["refused_operations"] == ["embeddings"]
        assert providers["node-b-llama"]["health"] == "available"  # not held against it
        assert providers["node-b-llama"]["consecutive_failures"] == 0
        assert (await catalog(stack, "models"))["pool"]["operations"] == ALL
        chats = [
            await sdk.chat.completions.create(
                model="pool", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            for _ in range(2)
        ]
        assert any(c.choices[0].message.content == "hello from llama" for c in chats)


async def test_with_only_the_501_provider_embeddings_are_a_400_the_sdk_does_not_retry(
    stack: Any, upstream: NoEmbeddingsUpstream
) -> None:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="unused") as sdk:  # max_retries=2
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.embeddings.create(model="solo", input="hello")
        assert refused.value.status_code == 400
        assert refused.value.code == "unsupported_operation"
        assert "'solo' does not offer embeddings" in refused.value.message
        assert upstream.embeddings["solo-llama"] == 1  # one request, no retry by anyone
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.embeddings.create(model="solo", input="hello")
        assert refused.value.code == "unsupported_operation"
        assert upstream.embeddings["solo-llama"] == 1  # now refused by the edge itself
        assert (await catalog(stack, "models"))["solo"]["operations"] == NO_EMBEDDINGS
        answer = await sdk.chat.completions.create(
            model="solo", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content == "hello from llama"
