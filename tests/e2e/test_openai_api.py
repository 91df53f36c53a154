"""The official openai SDK against a real edge, control-plane and two nodes with mock providers."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from pydantic import BaseModel

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # the `stack` fixture of conftest.py (a conftest cannot be imported)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    # max_retries=0: the SDK would retry 429/503 and hide what the edge answered
    async with AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0) as client:
        yield client


async def catalog(stack: Stack, kind: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.api_url.replace("/v1", f"/iop/v1/catalog/{kind}")) as response:
            assert response.status == 200
            return (await response.json())["data"]


async def wait_until_available(stack: Stack, providers: set[str]) -> None:
    async with asyncio.timeout(15):
        while True:
            rows = await catalog(stack, "providers")
            ready = {r["provider_id"] for r in rows if r["health"] == "available"}
            if providers <= ready:
                return
            await asyncio.sleep(0.1)


async def test_models_list_and_retrieve(stack: Stack, sdk: AsyncOpenAI) -> None:
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["mock-small", "solo"]
    model = await sdk.models.retrieve("mock-small")
    assert model.id == "mock-small"
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.models.retrieve("nope")
    assert info.value.code == "model_not_found"


async def test_chat_non_streaming_with_usage_and_the_public_model_id(
    stack: Stack, sdk: AsyncOpenAI
) -> None:
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    served_by: set[str] = set()
    for _ in range(2):
        answer = await sdk.chat.completions.create(
            model="mock-small",
            messages=[{"role": "user", "content": "say something"}],
            max_tokens=6,
        )
        assert answer.model == "mock-small"  # never the served name (mock-small-b)
        assert answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 6
        served_by.add(answer.id)
    assert len(served_by) == 2


async def test_chat_streaming_with_usage(stack: Stack, sdk: AsyncOpenAI) -> None:
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    stream = await sdk.chat.completions.create(
        model="mock-small",
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, models = "", None, None, set()
    async for chunk in stream:
        models.add(chunk.model)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert models == {"mock-small"}
    assert len(text.split()) == 5
    assert finish == "length"
    assert usage is not None
    assert usage.completion_tokens == 5


async def test_tools_pass_through_and_tool_calls_come_back(stack: Stack, sdk: AsyncOpenAI) -> None:
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    answer = await sdk.chat.completions.create(
        model="mock-small",
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
    )
    [call] = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert answer.choices[0].finish_reason == "tool_calls"

    stream = await sdk.chat.completions.create(
        model="mock-small",
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
        stream=True,
    )
    names = [
        tc.function.name
        async for chunk in stream
        if chunk.choices
        for tc in (chunk.choices[0].delta.tool_calls or [])
        if tc.function and tc.function.name
    ]
    assert names == ["get_weather"]


class Weather(BaseModel):
    """What the structured-output test asks the model for (the SDK sends its schema)."""

    city: str
    celsius: float
    windy: bool
    hours: list[int]


async def test_the_sdk_tool_round_trip_and_structured_output_on_the_mock(
    stack: Stack, sdk: AsyncOpenAI
) -> None:
    """The mock as a test partner: it calls an offered tool with arguments valid for the
    tool's schema, answers in text after the tool's result, and fills a json_schema."""
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    tool = openai.pydantic_function_tool(Weather, name="report_weather")
    messages: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    asked = await sdk.chat.completions.parse(model="mock-small", messages=messages, tools=[tool])
    [call] = asked.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)  # the SDK validated them
    messages += [
        asked.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answered = await sdk.chat.completions.create(
        model="mock-small", messages=messages, tools=[tool], max_tokens=3
    )
    assert answered.choices[0].message.content == "the quick brown "
    assert not answered.choices[0].message.tool_calls

    parsed = await sdk.chat.completions.parse(
        model="mock-small", messages=messages[:1], response_format=Weather
    )
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    async with sdk.chat.completions.stream(
        model="mock-small", messages=messages[:1], response_format=Weather
    ) as stream:
        final = await stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Weather)


async def test_completions_and_embeddings(stack: Stack, sdk: AsyncOpenAI) -> None:
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    completion = await sdk.completions.create(model="mock-small", prompt="once upon", max_tokens=4)
    assert completion.model == "mock-small"
    assert len(completion.choices[0].text.split()) == 4
    embeddings = await sdk.embeddings.create(model="mock-small", input=["a", "b"])
    assert [e.index for e in embeddings.data] == [0, 1]
    assert len(embeddings.data[0].embedding) > 0


async def test_error_cases(stack: Stack, sdk: AsyncOpenAI) -> None:
    await wait_until_available(stack, {"node-a-mock", "node-b-mock", "node-a-solo"})
    with pytest.raises(openai.NotFoundError) as not_found:
        await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"

    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model="mock-small", messages=[])
    assert bad.value.param == "messages"

    with pytest.raises(openai.APIStatusError) as failed:
        await sdk.chat.completions.create(
            model="mock-small",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"iop_mock": {"fail": "provider_error", "status": 500}},
        )
    assert failed.value.status_code == 502

    # "solo" has one provider with one slot and a queue of two: fill it, then overflow
    slow = {"iop_mock": {"delay_ms": 4000}}
    holders = [
        asyncio.create_task(
            sdk.chat.completions.create(
                model="solo", messages=[{"role": "user", "content": "x"}], extra_body=slow
            )
        )
        for _ in range(3)
    ]
    async with asyncio.timeout(5):  # one run in flight and two waiting: the queue is full
        while True:
            if {m["id"]: m for m in await catalog(stack, "models")}["solo"]["queued"] == 2:
                break
            await asyncio.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as full:
        await sdk.chat.completions.create(model="solo", messages=[{"role": "user", "content": "x"}])
    assert full.value.code == "queue_full"
    assert full.value.response.headers.get("retry-after")
    results = await asyncio.gather(*holders, return_exceptions=True)
    timeouts = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert timeouts, "queued requests behind a 4 s run must hit the 1.5 s queue timeout"
    assert all(t.status_code == 503 and t.code == "queue_timeout" for t in timeouts)


async def test_client_disconnect_mid_stream_frees_the_slot_on_edge_and_node(stack: Stack) -> None:
    await wait_until_available(stack, {"node-a-solo"})
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{stack.api_url}/chat/completions",
            json={
                "model": "solo",
                "messages": [{"role": "user", "content": "long"}],
                "max_tokens": 30_000,
                "stream": True,
                "iop_mock": {"fill": True},  # 30,000 tokens, not the mock's short answer
            },
        )
        assert response.status == 200
        await response.content.readline()  # the first chunk arrived: the run is going
        rows = {r["provider_id"]: r for r in await catalog(stack, "providers")}
        assert rows["node-a-solo"]["in_flight"] == 1
        response.close()  # the client goes away mid-stream
    async with asyncio.timeout(10):
        while True:
            rows = {r["provider_id"]: r for r in await catalog(stack, "providers")}
            node_metrics = await _metrics(stack.services["node-a"].admin_url)
            node_busy = 'iop_node_provider_in_flight{provider="node-a-solo"} 1.0' in node_metrics
            if rows["node-a-solo"]["in_flight"] == 0 and not node_busy:
                break
            await asyncio.sleep(0.1)
    assert 'outcome="cancelled"' in await _metrics(stack.services["node-a"].admin_url)


async def _metrics(admin_url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{admin_url}/metrics") as response:
            return await response.text()


async def test_catalog_shows_the_pool(stack: Stack) -> None:
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    providers = {r["provider_id"]: r for r in await catalog(stack, "providers")}
    row = providers["node-b-mock"]
    assert (row["node_id"], row["type"], row["category"]) == ("node-b", "mock", "local_inference")
    assert row["capacity"] == 2
    assert set(row["lifecycle_capabilities"]) == {
        "list_models",
        "load_model",
        "unload_model",
        "pull_model",
        "delete_model",
    }
    models = {m["id"]: m for m in await catalog(stack, "models")}
    assert models["mock-small"]["providers"] == {
        "node-a-mock": "mock-small",
        "node-b-mock": "mock-small-b",
    }
    assert set(models["mock-small"]["available_providers"]) == {"node-a-mock", "node-b-mock"}


async def test_client_disconnect_before_the_first_token_frees_the_slot(stack: Stack) -> None:
    await wait_until_available(stack, {"node-a-solo"})
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(
            http.post(
                f"{stack.api_url}/chat/completions",
                json={
                    "model": "solo",
                    "messages": [{"role": "user", "content": "slow start"}],
                    "stream": True,
                    "iop_mock": {"delay_ms": 30_000},
                },
            )
        )
        await eventually(lambda: _in_flight(stack, "node-a-solo", 1))
        request.cancel()  # the client gives up before any token
        await asyncio.gather(request, return_exceptions=True)
    await eventually(lambda: _in_flight(stack, "node-a-solo", 0))
    await eventually(lambda: _node_in_flight(stack, "node-a", "node-a-solo", 0))


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll another process's observable state until ``check`` holds (10 s at most)."""
    async with asyncio.timeout(10):
        while not await check():  # noqa: ASYNC110 - the state lives in another process
            await asyncio.sleep(0.05)


async def _in_flight(stack: Stack, provider_id: str, expected: int) -> bool:
    rows = {r["provider_id"]: r for r in await catalog(stack, "providers")}
    return bool(rows[provider_id]["in_flight"] == expected)


async def _node_in_flight(stack: Stack, node: str, provider_id: str, expected: int) -> bool:
    metrics = await _metrics(stack.services[node].admin_url)
    return f'iop_node_provider_in_flight{{provider="{provider_id}"}} {expected:.1f}' in metrics


async def test_the_provider_receives_the_served_name(stack: Stack, sdk: AsyncOpenAI) -> None:
    """node-b's history shows the served name it ran; the client saw the public id
    (docs/ARCHITECTURE.md#target-rewrite)."""
    await wait_until_available(stack, {"node-a-mock", "node-b-mock"})
    # concurrent, so the pool spreads them (sequential ones would all tie on node-a)
    answers = await asyncio.gather(
        *(
            sdk.chat.completions.create(
                model="mock-small", messages=[{"role": "user", "content": "x"}], max_tokens=20
            )
            for _ in range(4)
        )
    )
    assert {a.model for a in answers} == {"mock-small"}
    history = stack.root / "node-b-history.db"
    async with asyncio.timeout(10):
        while True:
            with sqlite3.connect(history) as db:
                targets = {row[0] for row in db.execute("SELECT target FROM runs")}
            if targets:
                break
            await asyncio.sleep(0.1)
    assert targets == {"mock-small-b"}
