"""The mock adapter: deterministic answers, limits, usage, tools, embeddings and drills."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonschema
import pytest

from iop_node.adapters.mock import WORDS, MockAdapter
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Delta, ExecutionSpec, Operation, Usage
from iop_node.errors import (
    ConfigError,
    InvalidRequest,
    ProviderFailed,
    ProviderTimeout,
    ProviderUnavailable,
)
from iop_node.ports import AdapterContext, LifecycleFlags
from iop_node.testing import RecordingSink, execute_as_node
from iop_proto import json_codec

CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there you"},
    ]
}
CHAT_WORDS = 5
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


@pytest.fixture
async def context() -> AsyncIterator[AdapterContext]:
    async with aiohttp.ClientSession() as http:
        yield AdapterContext(http=http, environ={})


def mock(context: AdapterContext, **settings: Any) -> MockAdapter:
    settings.setdefault("tokens_per_second", 0)
    config = ProviderConfig(id="m1", type="mock", models=("m-a", "m-b"), settings=settings)
    return MockAdapter(config, context)


def spec(
    body: dict[str, Any],
    *,
    operation: Operation = Operation.CHAT_COMPLETIONS,
    stream: bool = True,
    timeout: float = 30.0,
    run_id: str = "r1",
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id=run_id,
        model="m-a",
        provider_id="m1",
        adapter="mock",
        target="m-a",
        operation=operation,
        body_json=json_codec.dumps({"model": "m-a", **body}),
        stream=stream,
        include_usage=True,
        deadline=asyncio.get_running_loop().time() + timeout,
    )


def expected_text(tokens: int) -> str:
    return "".join(WORDS[i % len(WORDS)] + " " for i in range(tokens))


async def test_streams_one_delta_per_token_deterministically(context: AdapterContext) -> None:
    adapter = mock(context, default_tokens=20)
    first, second = RecordingSink(), RecordingSink()
    completion = await adapter.execute(spec(CHAT), first)
    await adapter.execute(spec(CHAT, run_id="r2"), second)

    assert first.text == second.text == expected_text(20)
    assert len(first.deltas) == 20
    assert [d.role for d in first.deltas] == ["assistant"] + [""] * 19
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage.of(CHAT_WORDS, 20)
    assert completion.result is None


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_a_large_max_tokens_still_gets_the_short_answer_ending_with_stop(
    context: AdapterContext, key: str
) -> None:
    """Agents ask 32,000 and continue on ``length``: the turn must end."""
    sink = RecordingSink()
    completion = await mock(context).execute(spec({**CHAT, key: 32_000}), sink)
    assert sink.text == expected_text(32)
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage.of(CHAT_WORDS, 32)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_a_smaller_max_tokens_cuts_the_answer_with_length(
    context: AdapterContext, key: str
) -> None:
    sink = RecordingSink()
    completion = await mock(context).execute(spec({**CHAT, key: 5}), sink)
    assert sink.text == expected_text(5)
    assert completion.finish_reason == "length"
    assert completion.usage == Usage.of(CHAT_WORDS, 5)


async def test_max_tokens_equal_to_the_answer_ends_with_stop(context: AdapterContext) -> None:
    completion = await mock(context).execute(spec({**CHAT, "max_tokens": 32}), RecordingSink())
    assert completion.finish_reason == "stop"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_fill_makes_max_tokens_the_length_and_finishes_with_length(
    context: AdapterContext, key: str
) -> None:
    sink = RecordingSink()
    body = {**CHAT, key: 40, "iop_mock": {"fill": True}}
    completion = await mock(context).execute(spec(body), sink)
    assert sink.text == expected_text(40)
    assert completion.finish_reason == "length"
    assert completion.usage == Usage.of(CHAT_WORDS, 40)


async def test_fill_without_max_tokens_is_the_default_answer(context: AdapterContext) -> None:
    sink = RecordingSink()
    body = {**CHAT, "iop_mock": {"fill": True}}
    completion = await mock(context, default_tokens=3).execute(spec(body), sink)
    assert sink.text == expected_text(3)
    assert completion.finish_reason == "stop"


async def test_default_length_comes_from_settings(context: AdapterContext) -> None:
    completion = await mock(context).execute(spec(CHAT, stream=False), RecordingSink())
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 32


async def test_non_streaming_chat_returns_an_openai_body(context: AdapterContext) -> None:
    sink = RecordingSink()
    completion = await mock(context).execute(spec({**CHAT, "max_tokens": 3}, stream=False), sink)
    assert sink.deltas == []
    body = completion.result
    assert body is not None
    assert body["id"] == "chatcmpl-r1"
    assert body["object"] == "chat.completion"
    assert body["model"] == "m-a"
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "the quick brown "},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def test_completions_count_the_prompt_and_return_text(context: AdapterContext) -> None:
    adapter = mock(context, default_tokens=2)
    body = {"prompt": "one two three"}
    completion = await adapter.execute(
        spec(body, operation=Operation.COMPLETIONS, stream=False), RecordingSink()
    )
    assert completion.result is not None
    assert completion.result["object"] == "text_completion"
    assert completion.result["choices"][0]["text"] == "the quick "
    assert completion.result["choices"][0]["finish_reason"] == "stop"
    assert completion.usage == Usage.of(3, 2)

    sink = RecordingSink()
    await adapter.execute(spec(body, operation=Operation.COMPLETIONS), sink)
    assert [(d.text, d.role) for d in sink.deltas] == [("the ", ""), ("quick ", "")]


async def test_prompt_words_include_text_parts(context: AdapterContext) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a b c d"}]}]}
    completion = await mock(context, default_tokens=0).execute(spec(parts), RecordingSink())
    assert completion.usage == Usage.of(4, 0)


async def test_paced_tokens_are_not_faster_than_the_rate(context: AdapterContext) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await mock(context, tokens_per_second=200).execute(
        spec({**CHAT, "max_tokens": 20}), RecordingSink()
    )
    # 20 tokens at 200/s cannot take less than 0.1 s; slack for the loop's clock resolution.
    assert loop.time() - started >= 0.09


async def test_delay_comes_before_the_first_token(context: AdapterContext) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    sink = RecordingSink()
    await mock(context).execute(
        spec({**CHAT, "max_tokens": 1, "iop_mock": {"delay_ms": 100}}), sink
    )
    assert loop.time() - started >= 0.09
    assert sink.text == "the "


async def test_embeddings_are_deterministic_unit_vectors(context: AdapterContext) -> None:
    adapter = mock(context)
    body = {"input": ["hello world", "other text here"]}
    first = await adapter.execute(
        spec(body, operation=Operation.EMBEDDINGS, stream=False), RecordingSink()
    )
    again = await adapter.execute(
        spec(body, operation=Operation.EMBEDDINGS, stream=False), RecordingSink()
    )
    assert first.result is not None
    assert again.result is not None
    assert first.result["data"] == again.result["data"]
    assert first.result["object"] == "list"
    assert first.result["model"] == "m-a"
    assert first.result["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert first.usage == Usage.of(5, 0)
    vectors = [item["embedding"] for item in first.result["data"]]
    assert [item["index"] for item in first.result["data"]] == [0, 1]
    assert all(len(v) == 8 for v in vectors)
    assert vectors[0] != vectors[1]
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-9


async def test_embeddings_in_base64_decode_to_the_float_vector(context: AdapterContext) -> None:
    adapter = mock(context)
    floats = await adapter.execute(
        spec({"input": "x"}, operation=Operation.EMBEDDINGS), RecordingSink()
    )
    packed = await adapter.execute(
        spec({"input": "x", "encoding_format": "base64"}, operation=Operation.EMBEDDINGS),
        RecordingSink(),
    )
    assert floats.result is not None
    assert packed.result is not None
    raw = base64.b64decode(packed.result["data"][0]["embedding"])
    decoded = struct.unpack("<8f", raw)
    assert decoded == pytest.approx(floats.result["data"][0]["embedding"], abs=1e-6)


async def test_required_tool_choice_calls_the_first_function(context: AdapterContext) -> None:
    body = {**CHAT, "tools": TOOLS, "tool_choice": "required"}
    completion = await mock(context).execute(spec(body, stream=False), RecordingSink())
    assert completion.finish_reason == "tool_calls"
    assert completion.result is not None
    message = completion.result["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "call_r1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
    ]
    assert completion.result["choices"][0]["finish_reason"] == "tool_calls"


async def test_named_tool_choice_streams_tool_call_deltas(context: AdapterContext) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    sink = RecordingSink()
    completion = await mock(context).execute(
        spec({**CHAT, "tools": TOOLS, "tool_choice": choice}), sink
    )
    assert completion.finish_reason == "tool_calls"
    head, args = sink.deltas
    assert head.role == "assistant"
    assert head.tool_calls[0].function_name == "get_time"
    assert head.tool_calls[0].id == "call_r1"
    assert head.tool_calls[0].type == "function"
    assert args.tool_calls[0].function_arguments == "{}"
    assert sink.text == ""


@pytest.mark.parametrize("choice", ["auto", None])
async def test_offered_tools_are_called_unless_a_tool_result_ends_the_conversation(
    context: AdapterContext, choice: str | None
) -> None:
    offered = {**CHAT, "tools": TOOLS, **({"tool_choice": choice} if choice else {})}
    called = await mock(context).execute(spec(offered, stream=False), RecordingSink())
    assert called.finish_reason == "tool_calls"
    assert called.result is not None
    (call,) = called.result["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    answered = {
        **offered,
        "messages": [*CHAT["messages"], called.result["choices"][0]["message"], result],
    }
    sink = RecordingSink()
    completion = await mock(context, default_tokens=2).execute(spec(answered), sink)
    assert completion.finish_reason == "stop"
    assert sink.text == "the quick "


async def called_tool(context: AdapterContext, body: dict[str, Any]) -> str | None:
    """The name of the tool the mock calls for ``body`` (None: it answered in text)."""
    completion = await mock(context, default_tokens=2).execute(spec(body), RecordingSink())
    if completion.finish_reason != "tool_calls":
        assert completion.finish_reason == "stop"
        return None
    streamed = RecordingSink()
    await mock(context).execute(spec(body), streamed)
    name = streamed.deltas[0].tool_calls[0].function_name
    plain = await mock(context).execute(spec(body, stream=False), RecordingSink())
    assert plain.result is not None
    assert plain.result["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == name
    return name


def said(*messages: Any) -> dict[str, Any]:
    return {"tools": TOOLS, "messages": list(messages)}


USER = {"role": "user", "content": "hi"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "noon"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (said(USER), "get_weather"),
        (said({"role": "user", "content": "what is get_time now?"}), "get_time"),
        # the exact case first, then any case; a word, not a part of one
        (said({"role": "user", "content": "use GET_TIME"}), "get_time"),
        (said({"role": "user", "content": "use get_timer"}), "get_weather"),
        (said({"role": "user", "content": "get_time or get_weather?"}), "get_time"),
        # of several text parts, the last that names a tool (Claude Code's reminders
        # come first, the prompt last)
        (
            said(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<reminder>get_time</reminder>"},
                        {"type": "text", "text": "call get_weather please"},
                    ],
                }
            ),
            "get_weather",
        ),
        # an agent harness's notes name tools too, after the user's words: not the user's
        # asking (the edge's note for Claude Code's system message inside messages)
        (
            said(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "call get_weather please"},
                        {"type": "text", "text": "<system>\nget_time is a tool\n</system>"},
                        {"type": "text", "text": " <system-reminder>get_time</system-reminder>"},
                    ],
                }
            ),
            "get_weather",
        ),
        # Claude Code's system message after the user's is not the user's turn ending
        (said(USER, {"role": "system", "content": "get_time is there"}), "get_weather"),
        (
            said(USER, CALL, RESULT, {"role": "assistant", "content": "noon"}, USER),
            "get_weather",
        ),
        (said(USER, CALL, RESULT), None),
        # a Messages tool result with text beside it: a tool then a user message
        (said(USER, CALL, RESULT, {"role": "user", "content": "<reminder/>"}), None),
        (said(USER, CALL, RESULT, {"role": "system", "content": "note"}), None),
        (said(USER, {"role": "assistant", "content": "prefill"}), None),
        ({**said(USER, CALL, RESULT), "tool_choice": "required"}, "get_weather"),
        (
            {**said(USER, CALL, RESULT), "tool_choice": {"type": "function", "name": "get_time"}},
            "get_time",
        ),
    ],
)
async def test_which_tool_is_called_and_when(
    context: AdapterContext, body: dict[str, Any], expected: str | None
) -> None:
    assert await called_tool(context, body) == expected


async def test_tool_choice_none_answers_with_text(context: AdapterContext) -> None:
    sink = RecordingSink()
    body = {**CHAT, "tools": TOOLS, "tool_choice": "none"}
    completion = await mock(context, default_tokens=2).execute(spec(body), sink)
    assert completion.finish_reason == "stop"
    assert sink.text == "the quick "


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


async def test_tool_arguments_stream_in_fragments_and_fit_the_schema(
    context: AdapterContext,
) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
    sink = RecordingSink()
    await mock(context).execute(spec({**CHAT, "tools": tools, "tool_choice": "required"}), sink)
    head, *fragments = sink.deltas
    assert head.tool_calls[0].function_name == "weather"
    assert len(fragments) == 2  # clients must put them together, as for real models
    arguments = json.loads("".join(f.tool_calls[0].function_arguments for f in fragments))
    jsonschema.validate(arguments, WEATHER)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_json_schema_response_format_gets_a_valid_instance(
    context: AdapterContext, stream: bool
) -> None:
    wanted = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
    }
    sink = RecordingSink()
    completion = await mock(context).execute(
        spec({**CHAT, "response_format": wanted}, stream=stream), sink
    )
    if stream:
        assert len(sink.deltas) > 1
        text = sink.text
    else:
        assert completion.result is not None
        text = completion.result["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), WEATHER)
    assert completion.finish_reason == "stop"


async def test_a_json_object_response_format_gets_an_object(context: AdapterContext) -> None:
    body = {**CHAT, "response_format": {"type": "json_object"}}
    completion = await mock(context).execute(spec(body, stream=False), RecordingSink())
    assert completion.result is not None
    assert isinstance(json.loads(completion.result["choices"][0]["message"]["content"]), dict)


async def test_unknown_named_tool_is_an_invalid_request(context: AdapterContext) -> None:
    choice = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(InvalidRequest):
        await mock(context).execute(
            spec({**CHAT, "tools": TOOLS, "tool_choice": choice}), RecordingSink()
        )


async def test_provider_error_drill_fails_after_n_tokens(context: AdapterContext) -> None:
    sink = RecordingSink()
    drill = {"fail": "provider_error", "after_tokens": 3, "status": 503}
    with pytest.raises(ProviderFailed) as caught:
        await mock(context).execute(spec({**CHAT, "iop_mock": drill}), sink)
    assert caught.value.provider_status == 503
    assert sink.text == expected_text(3)


async def test_unavailable_drill_defaults_to_failing_at_once(context: AdapterContext) -> None:
    sink = RecordingSink()
    with pytest.raises(ProviderUnavailable):
        await mock(context).execute(spec({**CHAT, "iop_mock": {"fail": "unavailable"}}), sink)
    assert sink.deltas == []


async def test_drill_after_more_tokens_than_the_answer_fails_at_the_end(
    context: AdapterContext,
) -> None:
    sink = RecordingSink()
    drill = {"fail": "provider_error", "after_tokens": 100}
    with pytest.raises(ProviderFailed) as caught:
        await mock(context).execute(spec({**CHAT, "max_tokens": 4, "iop_mock": drill}), sink)
    assert caught.value.provider_status == 500
    assert sink.text == expected_text(4)


async def test_timeout_drill_hangs_until_the_deadline(context: AdapterContext) -> None:
    sink = RecordingSink()
    drill = {"fail": "timeout", "after_tokens": 2}
    with pytest.raises(ProviderTimeout):
        await execute_as_node(mock(context), spec({**CHAT, "iop_mock": drill}, timeout=0.2), sink)
    assert sink.text == expected_text(2)


async def test_embeddings_honour_the_drill(context: AdapterContext) -> None:
    body = {"input": "x", "iop_mock": {"fail": "provider_error", "status": 429}}
    with pytest.raises(ProviderFailed) as caught:
        await mock(context).execute(spec(body, operation=Operation.EMBEDDINGS), RecordingSink())
    assert caught.value.provider_status == 429


async def test_slow_answer_past_the_deadline_is_a_provider_timeout(context: AdapterContext) -> None:
    adapter = mock(context, tokens_per_second=20, default_tokens=1000)
    sink = RecordingSink()
    with pytest.raises(ProviderTimeout):
        await execute_as_node(adapter, spec(CHAT, timeout=0.2), sink)
    assert 0 < len(sink.deltas) < 1000


async def test_cancel_stops_the_run(context: AdapterContext) -> None:
    adapter = mock(context, tokens_per_second=50, default_tokens=1000)
    sink = RecordingSink()
    task = asyncio.create_task(adapter.execute(spec(CHAT), sink))
    await sink.first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    produced = len(sink.deltas)
    await asyncio.sleep(0.05)
    assert len(sink.deltas) == produced < 1000


async def test_unpaced_run_stays_cancellable(context: AdapterContext) -> None:
    adapter = mock(context, tokens_per_second=0, default_tokens=10_000_000)

    class Quiet:
        """A sink that never yields: the adapter itself must give the loop a turn."""

        async def delta(self, delta: Delta) -> None:
            return None

    task = asyncio.create_task(adapter.execute(spec(CHAT), Quiet()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    "hook",
    [
        "fail",
        {"fail": "explode"},
        {"fail": "provider_error", "after_tokens": -1},
        {"delay_ms": "soon"},
    ],
)
async def test_malformed_hook_is_an_invalid_request(context: AdapterContext, hook: Any) -> None:
    with pytest.raises(InvalidRequest):
        await mock(context).execute(spec({**CHAT, "iop_mock": hook}), RecordingSink())


@pytest.mark.parametrize(
    "settings", [{"tokens_per_second": -1}, {"default_tokens": "many"}, {"default_tokens": 1.5}]
)
async def test_bad_settings_are_a_config_error(
    context: AdapterContext, settings: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError):
        mock(context, **settings)


async def test_probe_lists_the_configured_models(context: AdapterContext) -> None:
    adapter = mock(context)
    result = await adapter.probe()
    assert result.ok
    assert result.models == ("m-a", "m-b")
    assert adapter.name == "mock"
    assert adapter.capabilities() == LifecycleFlags(list_models=True)
    await adapter.aclose()


async def test_count_tokens_is_the_prompt_a_chat_run_reports(context: AdapterContext) -> None:
    adapter = mock(context)
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one two three"}]},
        ],
        "max_tokens": 2,
    }
    counted = await adapter.count_tokens(spec(body, operation=Operation.COUNT_TOKENS))
    ran = await adapter.execute(spec(body, stream=False), RecordingSink())
    assert counted.usage == Usage(5, 0, 5)
    assert ran.usage is not None
    assert ran.usage.prompt_tokens == 5
