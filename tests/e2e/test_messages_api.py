"""Anthropic's Messages API on a real stack (control-plane, edge, two mock nodes), driven
by the official ``anthropic`` SDK and LangChain's ``ChatAnthropic``.

The mock provider is deterministic: its text is "the quick brown fox ...", one word
a token, and its prompt tokens are the words of the messages, so counts can be
checked exactly. The contract tests read the raw wire (JSON and SSE) and hold every
object and event to the fields Anthropic's API reference requires
(``messages_contract``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import anthropic
import pytest
import pytest_asyncio
from anthropic import AsyncAnthropic

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _load_contract() -> ModuleType:
    """The contract checks, shared with the llama.cpp test (test modules are not a package)."""
    path = Path(__file__).with_name("messages_contract.py")
    spec = importlib.util.spec_from_file_location("iop_e2e_messages_contract", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


contract = _load_contract()


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 2,
        "max_queue": 4,
        "queue_timeout_ms": 3000,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 500,
    }


FLEET: dict[str, object] = {
    "models": [
        {
            "id": "mock-small",
            "max_output_tokens": 64,
            "providers": {"node-a-mock": "mock-small", "node-b-mock": "mock-small-b"},
        },
        {"id": "solo", "providers": {"node-a-solo": "solo-served"}},
    ],
    "nodes": [
        {
            "id": "node-a",
            "providers": [mock("node-a-mock", "mock-small"), mock("node-a-solo", "solo-served")],
        },
        {"id": "node-b", "providers": [mock("node-b-mock", "mock-small-b")]},
        {"id": "node-fuzz", "providers": []},
    ],
}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    # city required: the mock fills in the required properties (real tools list theirs)
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


class Keys:
    def __init__(self, full: str, small_only: str) -> None:
        self.full = full
        self.small_only = small_only


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(Path(tmp_path_factory.mktemp("messages")), FLEET) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keys(stack: Any) -> Keys:
    full = await issue(stack, "messages-full")
    small = await issue(stack, "messages-small", "--models", "mock-small")
    await wait_available(stack, full)
    return Keys(full, small)


async def issue(stack: Any, name: str, *options: str) -> str:
    """A key from the control-plane's CLI, once the edge knows it."""
    out = await stack.control_plane_cli("key", "issue", "--name", name, *options)
    found = re.search(r"sk-iop-\S+", out)
    assert found is not None, out
    secret = found.group(0)
    async with aiohttp.ClientSession() as http, asyncio.timeout(10):
        while True:
            async with http.get(stack.api_url + "/models", headers={"x-api-key": secret}) as r:
                if r.status == 200:
                    return secret
            await asyncio.sleep(0.05)


async def wait_available(stack: Any, key: str) -> None:
    url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
    async with aiohttp.ClientSession() as http, asyncio.timeout(15):
        while True:
            async with http.get(url, headers={"x-api-key": key}) as response:
                rows = (await response.json())["data"]
            if all(row["health"] == "available" for row in rows) and len(rows) == 3:
                return
            await asyncio.sleep(0.1)


def base_url(stack: Any) -> str:
    return str(stack.api_url).removesuffix("/v1")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack: Any, keys: Keys) -> AsyncIterator[AsyncAnthropic]:
    # max_retries=0: the SDK would retry 429/5xx and hide what the edge answered
    async with AsyncAnthropic(base_url=base_url(stack), api_key=keys.full, max_retries=0) as sdk:
        yield sdk


async def test_create_answers_a_message_with_stop_reason_and_usage(client: AsyncAnthropic) -> None:
    message = await client.messages.create(
        model="mock-small",
        max_tokens=5,
        system="You are terse.",
        messages=[{"role": "user", "content": "say five words"}],
    )
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "mock-small"
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text"
    assert block.text == "the quick brown fox jumps "
    assert message.stop_reason == "max_tokens"
    assert message.stop_sequence is None
    assert message.usage.output_tokens == 5
    assert message.usage.input_tokens == 6  # the mock counts words: system and user


async def test_max_tokens_is_held_to_the_models_cap(client: AsyncAnthropic) -> None:
    message = await client.messages.create(
        model="mock-small",
        max_tokens=20_000,
        messages=[{"role": "user", "content": "long"}],
        extra_body={"iop_mock": {"fill": True}},  # the mock's answer fills max_tokens
    )
    assert message.usage.output_tokens == 64  # the fleet's max_output_tokens
    assert message.stop_reason == "max_tokens"


async def test_stream_events_in_order_and_the_final_message(client: AsyncAnthropic) -> None:
    async with client.messages.stream(
        model="mock-small", max_tokens=4, messages=[{"role": "user", "content": "stream it"}]
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds its own "text" events
    assert raw[0] == "message_start"
    assert raw[1:3] == ["content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].type == "text"
    assert final.content[0].text == "the quick brown fox "
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 4
    assert final.usage.input_tokens == 2


async def test_tool_use_round_trip(client: AsyncAnthropic) -> None:
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    message = await client.messages.create(
        model="mock-small",
        max_tokens=50,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        messages=[question],
    )
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    assert isinstance(call.input, dict)
    assert isinstance(call.input["city"], str)  # valid for the tool's input_schema
    assert call.id
    answer = await client.messages.create(
        model="mock-small",
        max_tokens=3,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            question,
            {"role": "assistant", "content": message.content},  # type: ignore[typeddict-item]
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}],
            },
        ],
    )
    assert answer.content[0].type == "text"
    assert answer.stop_reason in {"end_turn", "max_tokens"}


async def test_a_named_tool_streams_as_a_tool_use_block(client: AsyncAnthropic) -> None:
    async with client.messages.stream(
        model="mock-small",
        max_tokens=50,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather?"}],
    ) as stream:
        final = await stream.get_final_message()
    [call] = final.content
    assert call.type == "tool_use"
    assert call.name == "get_weather"
    assert isinstance(call.input, dict)
    assert final.stop_reason == "tool_use"


async def test_count_tokens_is_the_prompt_the_provider_counts(client: AsyncAnthropic) -> None:
    messages: Any = [{"role": "user", "content": "count these four words"}]
    counted = await client.messages.count_tokens(
        model="mock-small", system="be brief", messages=messages
    )
    ran = await client.messages.create(
        model="mock-small", max_tokens=1, system="be brief", messages=messages
    )
    assert counted.input_tokens == ran.usage.input_tokens == 6


async def test_bearer_auth_token_works_as_well_as_x_api_key(stack: Any, keys: Keys) -> None:
    async with AsyncAnthropic(
        base_url=base_url(stack), auth_token=keys.full, api_key=None, max_retries=0
    ) as sdk:
        message = await sdk.messages.create(
            model="mock-small", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert message.usage.output_tokens == 1


async def test_a_wrong_key_is_an_authentication_error(stack: Any) -> None:
    async with AsyncAnthropic(
        base_url=base_url(stack), api_key="sk-iop-wrong", max_retries=0
    ) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await sdk.messages.create(
                model="mock-small", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
            )
    assert info.value.status_code == 401
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_a_model_outside_the_keys_list_is_a_permission_error(stack: Any, keys: Keys) -> None:
    async with AsyncAnthropic(
        base_url=base_url(stack), api_key=keys.small_only, max_retries=0
    ) as sdk:
        with pytest.raises(anthropic.PermissionDeniedError) as info:
            await sdk.messages.create(
                model="solo", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.body["error"]["type"] == "permission_error"  # type: ignore[index]


async def test_an_unknown_model_is_a_not_found_error(client: AsyncAnthropic) -> None:
    hello: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=1, messages=hello)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=hello)


async def test_a_bad_request_is_an_invalid_request_error(client: AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(
            model="mock-small",
            max_tokens=0,
            messages=[{"role": "user", "content": "hi"}],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


async def test_a_run_failing_mid_stream_ends_with_an_error_event(client: AsyncAnthropic) -> None:
    drill = {"iop_mock": {"fail": "provider_error", "after_tokens": 2}}
    async with client.messages.stream(
        model="mock-small",
        max_tokens=10,
        messages=[{"role": "user", "content": "fail soon"}],
        extra_body=drill,
    ) as stream:
        with pytest.raises(anthropic.APIStatusError) as info:
            await stream.get_final_message()
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]


async def test_errors_before_the_handler_are_anthropic_shaped(stack: Any, keys: Keys) -> None:
    url = base_url(stack)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json={"model": "mock-small"}) as response:
            assert response.status == 401  # no key at all
            assert (await response.json())["error"]["type"] == "authentication_error"
        headers = {"x-api-key": keys.full}
        async with http.post(url + "/v1/messages/nope", json={}, headers=headers) as response:
            assert response.status == 404
            body = await response.json()
            assert body["type"] == "error"
            assert body["error"]["type"] == "not_found_error"
        async with http.get(url + "/v1/messages", headers=headers) as response:
            assert response.status == 405
            assert (await response.json())["error"]["type"] == "invalid_request_error"
        async with http.post(url + "/v1/chat/completions", json={}, headers=headers) as response:
            assert "type" not in await response.json()  # OpenAI's paths keep OpenAI's errors


async def test_langchain_chat_anthropic_invoke_and_stream(stack: Any, keys: Keys) -> None:
    from langchain_anthropic import ChatAnthropic

    model = ChatAnthropic(  # type: ignore[call-arg]
        model="mock-small",
        base_url=base_url(stack),
        api_key=keys.full,
        max_tokens=3,
        max_retries=0,
    )
    try:
        await _chat_anthropic_calls(model)
    finally:
        # LangChain keeps one HTTP client per base URL for the process; this stack's is ours
        await model._async_client.close()


async def _chat_anthropic_calls(model: Any) -> None:
    answer = await model.ainvoke("hello there")
    assert answer.content == "the quick brown "
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["output_tokens"] == 3
    with_tools = model.bind_tools([WEATHER])
    called = await with_tools.ainvoke("What is the weather in Paris?")
    [call] = called.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str)
    pieces = [chunk async for chunk in model.astream("hello again")]
    text = "".join(str(chunk.content) if isinstance(chunk.content, str) else "" for chunk in pieces)
    streamed = "".join(
        part.get("text", "") if isinstance(part, dict) else str(part)
        for chunk in pieces
        for part in (chunk.content if isinstance(chunk.content, list) else [])
    )
    assert (text or streamed) == "the quick brown "


async def test_contract_of_the_message_and_every_stream_event(stack: Any, keys: Keys) -> None:
    """The raw wire, held to Anthropic's reference, for text and tool use, streamed or not."""
    url = base_url(stack) + "/v1/messages"
    headers = {"x-api-key": keys.full, "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
    bodies: list[dict[str, Any]] = [
        {"model": "mock-small", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        {
            "model": "mock-small",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "any"},
        },
    ]
    async with aiohttp.ClientSession() as http:
        for body in bodies:
            async with http.post(url, json=body, headers=headers) as response:
                assert response.status == 200
                contract.check_message(await response.json())
            async with http.post(url, json={**body, "stream": True}, headers=headers) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                contract.check_stream(contract.parse_sse(await response.text()))
        count_url = url + "/count_tokens"
        counted = {k: v for k, v in bodies[1].items() if k != "max_tokens"}
        async with http.post(count_url, json=counted, headers=headers) as response:
            assert response.status == 200
            contract.check_token_count(await response.json())
        async with http.post(url, json={"model": "solo"}, headers=headers) as response:
            assert response.status == 400
            contract.check_error(await response.json())
        drill = {
            **bodies[0],
            "stream": True,
            "iop_mock": {"fail": "provider_error", "after_tokens": 1},
        }
        async with http.post(url, json=drill, headers=headers) as response:
            events = contract.parse_sse(await response.text())
            assert events[-1][0] == "error"
            contract.check_error(events[-1][1])


# --- the real model: llama.cpp (SmolLM2-135M) in make run's stack ---------------------------


def _load_local_stack() -> ModuleType:
    """``test_local_stack``'s way of starting ``make run``'s stack (llama.cpp included)."""
    path = Path(__file__).with_name("test_local_stack.py")
    spec = importlib.util.spec_from_file_location("iop_e2e_local_stack", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_real_llamacpp_model_speaks_messages(tmp_path: Path) -> None:
    """SmolLM2's text is poor and varies: shapes, counts and order are checked, never text."""
    local = _load_local_stack()
    if (reason := local.missing_llamacpp()) is not None:
        pytest.skip(f"the real llama.cpp provider cannot run: {reason}")
    certs = tmp_path / "certs"
    devcerts = local.REPO / "tools" / "devcerts.py"
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(devcerts), "--out", str(certs), stdout=asyncio.subprocess.DEVNULL
    )
    assert await process.wait() == 0
    async with local.local_stack(tmp_path, certs) as (running, up):
        root = up["api"].removesuffix("/v1")
        async with AsyncAnthropic(base_url=root, api_key="unused", max_retries=0) as sdk:
            await _llamacpp_checks(sdk, root, local.LLAMA_MODEL)
        assert await running.stop() == 0, running.output


async def _llamacpp_checks(sdk: AsyncAnthropic, root: str, model: str) -> None:
    hello: Any = [{"role": "user", "content": "Say hello."}]
    message = await sdk.messages.create(
        model=model, max_tokens=8, system="You are a friendly assistant.", messages=hello
    )
    assert message.model == model
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert message.stop_reason in {"end_turn", "max_tokens"}
    assert 0 < message.usage.output_tokens <= 8
    counted = await sdk.messages.count_tokens(
        model=model, system="You are a friendly assistant.", messages=hello
    )
    assert counted.input_tokens == message.usage.input_tokens > 0

    async with sdk.messages.stream(
        model=model,
        max_tokens=8,
        messages=[{"role": "user", "content": "Count to three."}],
        stop_sequences=["\n\n"],
        # sampling: no longer parameters of this SDK's methods, still of the API
        extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 20},
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len([t for t in texts if t]) > 1, texts  # a delta per token, not one blob
    assert final.content[-1].type == "text"
    assert "".join(texts) == final.content[-1].text
    assert final.stop_reason in {"end_turn", "max_tokens", "stop_sequence"}
    assert final.usage.input_tokens > 0
    assert 0 < final.usage.output_tokens <= 8

    # A conversation that already called a tool: the history travels as chat's tool turns.
    turns: Any = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C."}
            ],
        },
    ]
    after_tool = await sdk.messages.create(
        model=model,
        max_tokens=8,
        messages=turns,
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert after_tool.stop_reason in {"end_turn", "max_tokens", "tool_use"}
    assert after_tool.usage.input_tokens > 0
    forced = await sdk.messages.create(
        model=model,
        max_tokens=40,
        messages=turns[:1],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
    )
    calls = [block for block in forced.content if block.type == "tool_use"]
    assert all(call.name == "get_weather" and isinstance(call.input, dict) for call in calls)
    # SmolLM2 under llama.cpp answers in text even when a tool is required: the provider's say

    url = root + "/v1/messages"
    body = {"model": model, "max_tokens": 6, "messages": hello}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body) as response:
            assert response.status == 200
            contract.check_message(await response.json())
        async with http.post(url, json={**body, "stream": True}) as response:
            assert response.status == 200
            contract.check_stream(contract.parse_sse(await response.text()))

    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(  # type: ignore[call-arg]
        model=model, base_url=root, api_key="unused", max_tokens=6, max_retries=0
    )
    try:
        answer = await chat.ainvoke("Say hi.")
        assert answer.content
        chunks = [chunk async for chunk in chat.astream("Say hi.")]
        assert len(chunks) > 1
    finally:
        await chat._async_client.close()


async def test_a_request_shaped_as_claude_code_sends_it_streams_to_message_stop(
    stack: Any, keys: Keys
) -> None:
    """What Claude Code sends: ``?beta=true``, beta headers, system blocks and tools with
    ``cache_control``, ``metadata.user_id``, thinking, a history with thinking and tool
    turns, and a stream."""
    cache = {"type": "ephemeral"}
    body = {
        "model": "mock-small",
        "max_tokens": 32000,
        "stream": True,
        "temperature": 1,
        "metadata": {"user_id": "user_abc_account__session_1"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": cache},
            {"type": "text", "text": "Use the tools.", "cache_control": cache},
        ],
        "tools": [
            {**WEATHER, "cache_control": cache},
            {
                "name": "Bash",
                "description": "Run a command.",
                "input_schema": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                    "additionalProperties": False,
                    "$schema": "http://json-schema.org/draft-07/schema#",
                },
            },
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "list files", "cache_control": cache}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use Bash", "signature": "abc"},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py\nb.py"}
                ],
            },
        ],
    }
    headers = {
        "x-api-key": keys.full,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    url = base_url(stack) + "/v1/messages?beta=true"
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, json=body, headers=headers) as response,
    ):
        assert response.status == 200
        events = contract.parse_sse(await response.text())
    contract.check_stream(events)
    stop = next(data for name, data in events if name == "message_delta")
    # the mock answers the tool result in text, short, ending the turn (32000 held to 64)
    assert stop["delta"]["stop_reason"] == "end_turn"
    assert stop["usage"]["output_tokens"] == 32


CLAUDE_CODE = Path(__file__).with_name("data") / "claude_code_2.1.197_messages.json"


async def test_claude_codes_captured_request_streams_to_message_stop(
    stack: Any, keys: Keys
) -> None:
    """The request Claude Code 2.1.197 sent (texts trimmed, shapes kept): its billing
    header block, a system message inside ``messages``, thinking ``adaptive``,
    ``output_config.effort``, ``context_management``, ``cache_control`` and its tools,
    with its headers; plus a server tool, which is left out and named."""
    captured = json.loads(CLAUDE_CODE.read_text("utf-8"))
    body = captured["body"]
    body["tools"].append({"type": "web_search_20250305", "name": "web_search", "max_uses": 8})
    headers = {**captured["headers"], "x-api-key": keys.full}
    url = base_url(stack) + "/v1/messages?beta=true"
    async with aiohttp.ClientSession() as http:
        async with http.head(base_url(stack) + "/") as probe:
            assert probe.status == 200
        async with http.post(url, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            assert response.headers["request-id"].startswith("req_")
            assert response.headers["x-iop-dropped-tools"] == "web_search_20250305"
            events = contract.parse_sse(await response.text())
        async with http.post(
            url.replace("messages", "messages/count_tokens"),
            json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")},
            headers=headers,
        ) as response:
            assert response.status == 200, await response.text()
            counted = await response.json()
    contract.check_stream(events)
    stop = next(data for name, data in events if name == "message_delta")
    assert stop["delta"]["stop_reason"] == "tool_use"  # the mock calls the first tool offered
    assert stop["usage"]["input_tokens"] > 0
    [called] = [
        data["content_block"]["name"]
        for name, data in events
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use"
    ]
    assert called == body["tools"][0]["name"]
    assert counted["input_tokens"] > 0
