"""The OpenAI-compatible adapter against a real llama.cpp server (xllamacpp + SmolLM2-135M).

The server runs in a child process (its C++ threads never touch this test's
event loop, and it dies with the fixture: it serves until its stdin closes).
A 135M model's text is poor and varies between runs, so these tests check
shape, non-empty text, token counts and finish reasons, never content.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from iop_node.adapters import openai_compat, tokenizer
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.adapters.provider_http import ProviderHttp
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, Operation
from iop_node.errors import ContextLengthExceeded, ErrorCode, InvalidRequest, ProviderTimeout
from iop_node.ports import AdapterContext
from iop_node.testing import RecordingSink, execute_as_node, llamacpp_child, llamacpp_missing
from iop_proto import json_codec

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"


@pytest.fixture(scope="session")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a llama.cpp server with SmolLM2-135M, 2 slots, 1 thread."""
    if (missing := llamacpp_missing()) is not None:
        pytest.skip(missing)
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    with llamacpp_child(log, alias=MODEL, ctx=2048, slots=2) as url:
        yield url


@contextlib.asynccontextmanager
async def lent(http: aiohttp.ClientSession) -> AsyncIterator[AdapterContext]:
    """What the node lends its adapters: both HTTP clients, the engines' closed after."""
    engines = ProviderHttp()
    try:
        yield AdapterContext(http, {}, engines=engines)
    finally:
        await engines.aclose()


@pytest.fixture
async def adapter(llamacpp: str) -> AsyncIterator[OpenAICompatAdapter]:
    async with aiohttp.ClientSession() as http, lent(http) as context:
        config = ProviderConfig(
            id="local-llamacpp", type="llamacpp", settings={"endpoint": llamacpp}
        )
        built = openai_compat.factory("llamacpp")(config, context)
        assert isinstance(built, OpenAICompatAdapter)
        yield built
        await built.aclose()


def spec(
    body: dict[str, Any],
    *,
    operation: Operation = Operation.CHAT_COMPLETIONS,
    stream: bool = False,
    seconds: float = 60.0,
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="r",
        model=MODEL,
        provider_id="local-llamacpp",
        adapter="llamacpp",
        target=MODEL,
        operation=operation,
        body_json=json_codec.dumps({"model": MODEL, **body}),
        stream=stream,
        include_usage=True,
        deadline=asyncio.get_running_loop().time() + seconds,
    )


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Write a short story about a cat."}]
    return {"messages": messages, "max_tokens": max_tokens, **extra}


async def slots(http: aiohttp.ClientSession, base: str) -> list[dict[str, Any]]:
    async with http.get(f"{base}/slots") as response:
        assert response.status == 200
        result: list[dict[str, Any]] = json.loads(await response.read())
        return result


async def wait_all_idle(base: str, within: float) -> float:
    """Seconds until llama.cpp reports every slot idle; fails past ``within``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with aiohttp.ClientSession() as http:
        while any(slot["is_processing"] for slot in await slots(http, base)):
            assert loop.time() - started < within, "a slot is still busy"
            await asyncio.sleep(0.05)
    return loop.time() - started


async def test_chat_non_stream(adapter: OpenAICompatAdapter) -> None:
    completion = await adapter.execute(spec(chat(8)), RecordingSink())

    result = completion.result
    assert result is not None
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"]["content"]
    assert completion.finish_reason in {"stop", "length"}
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert 0 < completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


async def test_chat_stream(adapter: OpenAICompatAdapter) -> None:
    sink = RecordingSink()
    completion = await adapter.execute(spec(chat(8), stream=True), sink)

    assert len(sink.deltas) > 1
    assert sink.deltas[0].role == "assistant"
    assert sink.text
    assert sink.deltas[-1].finish_reason in {"stop", "length"}
    assert completion.finish_reason == sink.deltas[-1].finish_reason
    assert completion.result is None
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert 0 < completion.usage.completion_tokens <= 8


async def test_text_completion(adapter: OpenAICompatAdapter) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8}
    completion = await adapter.execute(spec(body, operation=Operation.COMPLETIONS), RecordingSink())
    assert completion.result is not None
    assert completion.result["choices"][0]["text"]
    assert completion.finish_reason in {"stop", "length"}
    assert completion.usage is not None
    assert completion.usage.completion_tokens > 0

    sink = RecordingSink()
    streamed = await adapter.execute(spec(body, operation=Operation.COMPLETIONS, stream=True), sink)
    assert sink.text
    assert streamed.finish_reason in {"stop", "length"}
    assert streamed.usage is not None
    assert streamed.usage.completion_tokens > 0


async def test_probe_lists_the_alias(adapter: OpenAICompatAdapter) -> None:
    result = await adapter.probe()
    assert result.ok, result.detail
    assert MODEL in result.models


async def test_uninterpreted_parameters_pass_through(adapter: OpenAICompatAdapter) -> None:
    # seed and logit_bias are accepted; ignore_eos (llama.cpp's own) visibly takes effect.
    body = chat(12, seed=7, logit_bias={}, ignore_eos=True, top_k=20)
    completion = await adapter.execute(spec(body), RecordingSink())
    assert completion.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 12


async def test_provider_errors_keep_their_status(adapter: OpenAICompatAdapter) -> None:
    with pytest.raises(InvalidRequest) as bad:
        await adapter.execute(spec({"messages": "not a list"}), RecordingSink())
    assert bad.value.provider_status == 400


async def test_cancel_mid_stream_frees_the_slot(
    adapter: OpenAICompatAdapter, llamacpp: str
) -> None:
    sink = RecordingSink()
    # ignore_eos: the model cannot finish early, so an idle slot can only mean the abort.
    run = asyncio.create_task(adapter.execute(spec(chat(200, ignore_eos=True), stream=True), sink))
    await asyncio.wait_for(sink.first.wait(), 30)
    async with aiohttp.ClientSession() as http:
        (busy,) = [slot for slot in await slots(http, llamacpp) if slot["is_processing"]]
    assert busy["next_token"][0]["n_remain"] >= 150  # seconds of work left at ~50 tokens/s
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run

    await wait_all_idle(llamacpp, within=2.0)
    # Both slots serve again at once.
    loop = asyncio.get_running_loop()
    started = loop.time()
    done = await asyncio.gather(
        *(adapter.execute(spec(chat(4)), RecordingSink()) for _ in range(2))
    )
    assert all(c.finish_reason in {"stop", "length"} for c in done)
    assert loop.time() - started < 15


async def test_deadline_becomes_provider_timeout(
    adapter: OpenAICompatAdapter, llamacpp: str
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProviderTimeout):
        await execute_as_node(
            adapter, spec(chat(200, ignore_eos=True), stream=True, seconds=0.5), RecordingSink()
        )
    assert loop.time() - started < 2
    # The abort itself is proven by the cancel test; here the deadline may fall in prompt
    # processing, where llama.cpp notices the disconnect only at its first token. Wait
    # generously so the next test finds both slots free.
    await wait_all_idle(llamacpp, within=15.0)


async def test_streamed_logprobs_reach_the_deltas(adapter: OpenAICompatAdapter) -> None:
    """llama.cpp streams each token's logprobs: they travel with the delta, as JSON."""
    sink = RecordingSink()
    await adapter.execute(spec(chat(4, logprobs=True, top_logprobs=2), stream=True), sink)

    carried = [json.loads(d.logprobs_json) for d in sink.deltas if d.logprobs_json]
    assert carried, "no delta carried logprobs"
    tokens = [entry for logprobs in carried for entry in logprobs["content"]]
    assert all(isinstance(entry["logprob"], float) for entry in tokens)
    assert all(len(entry["top_logprobs"]) == 2 for entry in tokens)
    assert "".join(entry["token"] for entry in tokens) == sink.text


async def test_an_operation_the_server_does_not_offer_is_the_clients_error(
    adapter: OpenAICompatAdapter,
) -> None:
    """llama.cpp started without --embeddings answers 501: an invalid request naming the
    model and the operation, not a provider failure (which would be retried and counted)."""
    body = {"input": "hello"}
    with pytest.raises(InvalidRequest) as info:
        await adapter.execute(spec(body, operation=Operation.EMBEDDINGS), RecordingSink())
    assert info.value.provider_status == 501
    assert f"'{MODEL}' does not offer embeddings" in info.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_past_the_context_is_context_length_exceeded_with_its_numbers(
    adapter: OpenAICompatAdapter, llamacpp: str, stream: bool
) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"{llamacpp}/props") as response:
        n_ctx = (await response.json())["default_generation_settings"]["n_ctx"]  # a slot's
    long = [{"role": "user", "content": "hello " * (n_ctx + 100)}]
    with pytest.raises(ContextLengthExceeded) as info:
        await adapter.execute(
            spec({"messages": long, "max_tokens": 4}, stream=stream), RecordingSink()
        )
    failure = info.value
    assert failure.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert (failure.provider_status, failure.context_window) == (400, n_ctx)
    assert failure.prompt_tokens > n_ctx
    assert "exceeds the available context size" in failure.message
    # Any other refusal stays an invalid request: only the overflow is told apart.
    with pytest.raises(InvalidRequest) as other:
        await adapter.execute(spec({"messages": "not a list"}), RecordingSink())
    assert not isinstance(other.value, ContextLengthExceeded)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    "body",
    [
        {
            "messages": [
                {"role": "system", "content": "You are a friendly assistant."},
                {"role": "user", "content": "Say hello."},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather in Paris?"},
                        {"type": "text", "text": "<system>\nBe brief.\n</system>"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "reasoning_effort": "high",
        },
    ],
)
async def test_count_tokens_is_the_prompt_a_chat_completion_counts(
    adapter: OpenAICompatAdapter, body: dict[str, Any]
) -> None:
    """llama.cpp's template and tokenizer, asked without generating: the same count as
    the prompt_tokens of a chat completion of the same body."""
    counted = await adapter.count_tokens(spec(body, operation=Operation.COUNT_TOKENS))
    ran = await adapter.execute(spec({**body, "max_tokens": 1}), RecordingSink())
    assert counted.usage is not None
    assert ran.usage is not None
    assert counted.usage.prompt_tokens == ran.usage.prompt_tokens > 10
    assert counted.usage.completion_tokens == 0
    assert counted.provider_us > 0


async def wait_busy(http: aiohttp.ClientSession, base: str, count: int, within: float) -> None:
    """Until llama.cpp reports ``count`` slots processing; fails past ``within``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while sum(slot["is_processing"] for slot in await slots(http, base)) < count:
        assert loop.time() - started < within, "the slots did not start"
        await asyncio.sleep(0.05)


async def test_count_tokens_takes_no_generation_slot(llamacpp: str) -> None:
    """Both of llama.cpp's slots busy generating: a count still answers at once."""
    async with aiohttp.ClientSession() as http, lent(http) as context:
        config = ProviderConfig(
            id="local-llamacpp", type="llamacpp", settings={"endpoint": llamacpp}
        )
        adapter = openai_compat.factory("llamacpp")(config, context)
        assert isinstance(adapter, OpenAICompatAdapter)
        busy = [
            asyncio.create_task(adapter.execute(spec(chat(400), stream=True), RecordingSink()))
            for _ in range(2)
        ]
        try:
            await wait_busy(http, llamacpp, 2, within=30)
            count_spec = spec(chat(1), operation=Operation.COUNT_TOKENS)
            async with asyncio.timeout(5):
                counted = await adapter.count_tokens(count_spec)
            assert counted.usage is not None
            assert counted.usage.prompt_tokens > 0
            assert sum(s["is_processing"] for s in await slots(http, llamacpp)) == 2
        finally:
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
        await wait_all_idle(llamacpp, within=10)


async def test_a_server_without_a_tokenizer_endpoint_does_not_offer_count_tokens(
    llamacpp: str,
) -> None:
    """SGLang's flavor has no tokenizer style; a llama.cpp-style call to a path the server
    lacks is a 404: both are the provider not offering the operation (501)."""
    async with aiohttp.ClientSession() as http, lent(http) as context:
        config = ProviderConfig(id="p", type="sglang", settings={"endpoint": llamacpp})
        sglang = openai_compat.factory("sglang")(config, context)
        assert isinstance(sglang, OpenAICompatAdapter)
        with pytest.raises(InvalidRequest) as info:
            await sglang.count_tokens(spec(chat(1), operation=Operation.COUNT_TOKENS))
        assert info.value.provider_status == 501
        with pytest.raises(InvalidRequest) as missing:
            await tokenizer.prompt_tokens(
                tokenizer.LLAMACPP, context.engines, llamacpp + "/nope", {}, chat(1)
            )
        assert missing.value.provider_status == 501
