"""A real vLLM behind a real IOP stack: client -> edge -> node (``vllm`` provider) -> vLLM.

The stack is ``tests/conftest.py``'s (control-plane, edge, two nodes, worker, mTLS) with
a fleet of its own: ``smollm2:135m`` is served by node-a's vLLM provider under vLLM's
name ``smollm2-135m-vllm`` (the edge rewrites the model), and ``misnamed`` points at
node-b's provider for the same vLLM under a name vLLM does not serve, which is how an
operator's typo looks from the client. The official OpenAI SDK is the client. Text is
never checked (see ``test_vllm_adapter``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(420)]

MODEL = "smollm2:135m"
MISNAMED = "misnamed"
PROVIDER = "node-a-vllm"
WRONG = "node-b-vllm-wrong-name"
STORY: Any = [{"role": "user", "content": "Write a short story about a cat."}]
LIST_ONLY = {
    "list_models": True,
    "load_model": False,
    "unload_model": False,
    "pull_model": False,
    "delete_model": False,
}


def fleet(endpoint: str, served: str) -> dict[str, object]:
    def vllm(provider_id: str, name: str) -> dict[str, object]:
        return {
            "id": provider_id,
            "type": "vllm",
            "category": "local_inference",
            "endpoint": endpoint,
            "models": [name],
            "capacity": 4,  # vLLM's --max-num-seqs
            "max_queue": 8,
            "request_timeout_ms": 120_000,
        }

    return {
        "models": [
            {"id": MODEL, "display_name": "SmolLM2 135M", "providers": {PROVIDER: served}},
            {"id": MISNAMED, "providers": {WRONG: "not-served-here"}},
        ],
        "nodes": [
            {"id": "node-a", "providers": [vllm(PROVIDER, served)]},
            {"id": "node-b", "providers": [vllm(WRONG, "not-served-here")]},
        ],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, vllm_server: Any
) -> AsyncIterator[Any]:
    root = Path(tmp_path_factory.mktemp("vllm-stack"))
    async with start_stack_factory(root, fleet(vllm_server.url, vllm_server.served)) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def sdk(stack: Any, vllm_server: Any) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0) as client:
        yield client
    await vllm_server.wait_idle()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            assert response.status == 200, await response.text()
            return await response.json()


@pytest.mark.asyncio(loop_scope="module")
async def test_chat_through_the_edge(sdk: AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8)
    assert answer.model == MODEL  # the public id, not vLLM's served name
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert answer.usage is not None
    assert answer.usage.prompt_tokens > 0
    assert 0 < answer.usage.completion_tokens <= 8
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream_through_the_edge(sdk: AsyncOpenAI, include_usage: bool) -> None:
    """Usage reaches the client in a last chunk only when it asks (the node always asks
    vLLM for it, to count tokens)."""
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=STORY,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": include_usage},
    )
    chunks = [chunk async for chunk in stream]
    assert {chunk.model for chunk in chunks} == {MODEL}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in {"stop", "length"}
    usages = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usages) == 1
        assert chunks[-1].usage is not None
        assert not chunks[-1].choices
        assert 0 < usages[0].completion_tokens <= 8
    else:
        assert usages == []


@pytest.mark.asyncio(loop_scope="module")
async def test_completions_through_the_edge(sdk: AsyncOpenAI) -> None:
    answer = await sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert answer.model == MODEL
    assert answer.choices[0].text
    assert answer.usage is not None
    assert 0 < answer.usage.completion_tokens <= 8

    stream = await sdk.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens <= 8


@pytest.mark.asyncio(loop_scope="module")
async def test_stop_through_the_edge(sdk: AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(
        model=MODEL,
        messages=STORY,
        max_tokens=120,
        stop=["."],
        temperature=0,
        extra_body={"ignore_eos": True},  # vLLM's own parameter, passed through
    )
    assert answer.choices[0].finish_reason == "stop"
    assert "." not in (answer.choices[0].message.content or "")
    assert answer.usage is not None
    assert answer.usage.completion_tokens < 120


@pytest.mark.asyncio(loop_scope="module")
async def test_a_served_name_vllm_does_not_know_is_model_not_found(sdk: AsyncOpenAI) -> None:
    """vLLM's 404 ("The model ... does not exist") becomes OpenAI's own 404
    ``model_not_found`` at the edge, with vLLM's message; streamed or not."""
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.chat.completions.create(model=MISNAMED, messages=STORY, max_tokens=4)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert "does not exist" in info.value.message
    body: Any = info.value.body
    assert body["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(
            model=MISNAMED,
            messages=STORY,
            max_tokens=4,
            stream=True,
        )


@pytest.mark.asyncio(loop_scope="module")
async def test_max_tokens_past_the_context_is_a_bad_request(
    sdk: AsyncOpenAI, vllm_server: Any
) -> None:
    """Under the edge's own limit, past vLLM's context: vLLM's 400, as OpenAI's 400
    ``context_length_exceeded`` naming vLLM's context length."""
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(
            model=MODEL,
            messages=STORY,
            max_tokens=2 * vllm_server.max_model_len,
        )
    assert info.value.status_code == 400
    body: Any = info.value.body
    assert body["type"] == "invalid_request_error"
    assert (body["code"], body["param"]) == ("context_length_exceeded", "messages")
    assert str(vllm_server.max_model_len) in info.value.message


@pytest.mark.asyncio(loop_scope="module")
async def test_catalog_shows_the_vllm_provider(
    stack: Any, sdk: AsyncOpenAI, vllm_server: Any
) -> None:
    catalog = await get_json(stack.api_url.removesuffix("/v1") + "/iop/v1/catalog/providers")
    rows = {row["provider_id"]: row for row in catalog["data"]}
    row = rows[PROVIDER]
    assert row["type"] == "vllm"
    assert row["category"] == "local_inference"
    assert row["health"] == "available"  # the node's probe: vLLM's /v1/models answered
    assert row["models"] == [vllm_server.served]  # what that probe listed
    assert row["serves"] == [MODEL]
    assert row["capacity"] == 4
    assert row["lifecycle_capabilities"] == LIST_ONLY
    assert rows[WRONG]["lifecycle_capabilities"] == LIST_ONLY

    models = {model.id for model in (await sdk.models.list()).data}
    assert {MODEL, MISNAMED} <= models


@pytest.mark.asyncio(loop_scope="module")
async def test_client_disconnect_aborts_the_request_in_vllm(stack: Any, vllm_server: Any) -> None:
    """A client that goes away mid-stream: the edge cancels the run, the node closes its
    connection to vLLM, and vLLM aborts the request (its own metrics say so)."""
    generated_before = await vllm_server.generated()
    body = {
        "model": MODEL,
        "messages": STORY,
        "max_tokens": 600,
        "stream": True,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.api_url}/chat/completions", json=body) as response:
            assert response.status == 200
            first = await response.content.readline()
            while not first.startswith(b"data: {"):
                first = await response.content.readline()
            assert json.loads(first.removeprefix(b"data: "))["object"] == "chat.completion.chunk"
            assert await vllm_server.running() == 1
            response.close()  # the client disconnects, 599 tokens before the end
    await vllm_server.wait_idle(within_s=10)  # 600 tokens would take 30 s and more
    assert await vllm_server.generated() - generated_before < 300


@pytest.mark.asyncio(loop_scope="module")
async def test_responses_api_through_vllm(sdk: AsyncOpenAI) -> None:
    """POST /v1/responses at the edge, translated to chat for the vLLM provider: an
    answer, a stream of events, and a chain by ``previous_response_id``."""
    response = await sdk.responses.create(
        model=MODEL, instructions="Answer briefly.", input="Say hello.", max_output_tokens=8
    )
    assert response.object == "response"
    assert response.model == MODEL
    assert response.status in {"completed", "incomplete"}
    assert response.output_text
    assert response.usage is not None
    assert response.usage.input_tokens > 0
    assert 0 < response.usage.output_tokens <= 8

    follow = await sdk.responses.create(
        model=MODEL, previous_response_id=response.id, input="Again.", max_output_tokens=8
    )
    assert follow.usage is not None
    assert follow.usage.input_tokens > response.usage.input_tokens  # the chain was sent
    assert follow.previous_response_id == response.id

    deltas: list[str] = []
    final: Any = None
    async with sdk.responses.stream(
        model=MODEL, input="Count to three.", max_output_tokens=8
    ) as events:
        async for event in events:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert len(deltas) > 1
    assert final is not None
    assert final.output_text == "".join(deltas)
    assert final.usage is not None
    assert 0 < final.usage.output_tokens <= 8


@pytest.mark.asyncio(loop_scope="module")
async def test_concurrent_requests_share_vllms_batch(sdk: AsyncOpenAI, stack: Any) -> None:
    """Four at once, the provider's capacity: all answered, none queued at the edge."""
    answers = await asyncio.gather(
        *(sdk.chat.completions.create(model=MODEL, messages=STORY, max_tokens=16) for _ in range(4))
    )
    assert all(a.usage is not None and a.usage.completion_tokens > 0 for a in answers)
