"""The wire objects built from run events, checked without a server.

The per-token fast path writes JSON from a byte template; a property test holds
it to exactly what the general (dict + encoder) path produces for any text.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.domain.fleet import Operation
from iop_edge.errors import ProviderFailed
from iop_edge.formats.openai import DONE, ChunkStream, chat_choice, render_result, text_choice


def event(frame: bytes) -> dict[str, Any]:
    assert frame.startswith(b"data: ")
    assert frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2  # one line per event, whatever the text holds
    parsed: dict[str, Any] = json.loads(frame[len(b"data: ") : -2])
    return parsed


@given(st.text(min_size=1))
def test_the_token_fast_path_matches_the_general_encoding(text: str) -> None:
    for operation, general in (
        (Operation.CHAT_COMPLETIONS, lambda d: chat_choice(d, first=False)),
        (Operation.COMPLETIONS, text_choice),
    ):
        stream = ChunkStream(operation, run_id="r", model="m:1/x", created=5)
        stream.delta(Delta(text="first"))  # the first chunk of a choice takes the slow path
        token = Delta(text=text)
        chunk = event(stream.delta(token))
        assert chunk["choices"] == [general(token)]
        assert chunk["model"] == "m:1/x"


def test_the_first_chat_chunk_names_the_role_and_later_ones_do_not() -> None:
    stream = ChunkStream(Operation.CHAT_COMPLETIONS, run_id="r", model="m", created=5)
    first = event(stream.delta(Delta(text="a")))
    second = event(stream.delta(Delta(text="b", reasoning_text="why")))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert second["choices"][0]["delta"] == {"content": "b", "reasoning_content": "why"}


def test_tool_call_fragments_carry_only_what_the_node_sent() -> None:
    stream = ChunkStream(Operation.CHAT_COMPLETIONS, run_id="r", model="m", created=5)
    opening = ToolCallDelta(index=1, id="c", type="function", function_name="f")
    later = ToolCallDelta(index=1, function_arguments='{"a":')
    head = event(stream.delta(Delta(tool_calls=[opening])))
    tail = event(stream.delta(Delta(tool_calls=[later])))
    assert head["choices"][0]["delta"]["tool_calls"] == [
        {"index": 1, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    ]
    assert tail["choices"][0]["delta"]["tool_calls"] == [
        {"index": 1, "function": {"arguments": '{"a":'}}
    ]


def test_usage_chunk_falls_back_to_a_delta_usage() -> None:
    stream = ChunkStream(Operation.COMPLETIONS, run_id="r", model="m", created=5)
    stream.delta(Delta(text="x", usage=Usage(prompt_tokens=2, completion_tokens=1)))
    chunk = event(stream.usage_chunk(Completed()))
    assert chunk["choices"] == []
    assert chunk["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 1,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_stream_without_deltas_still_closes_with_a_finish_chunk() -> None:
    stream = ChunkStream(Operation.CHAT_COMPLETIONS, run_id="r", model="m", created=5)
    chunk = event(stream.closing(Completed()).removesuffix(DONE))
    assert chunk["choices"] == [
        {"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": "stop"}
    ]


def test_render_result_replaces_the_model_and_the_id_and_keeps_the_rest() -> None:
    provider = {"id": "x", "model": "served", "choices": [], "n": 12345678901234567890}
    complete = Completed(result_json=json.dumps(provider).encode())
    body = render_result(
        Operation.CHAT_COMPLETIONS, complete, [], run_id="r", model="public", created=5
    )
    assert json.loads(body) == {**provider, "model": "public", "id": "chatcmpl-r"}


def test_a_provider_choice_gets_the_fields_openai_always_sends() -> None:
    provider = {
        "id": "llama-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
            },
            {"index": 1, "message": {"role": "assistant", "refusal": "no"}, "logprobs": {"c": []}},
        ],
    }
    complete = Completed(result_json=json.dumps(provider).encode())
    result = json.loads(
        render_result(Operation.CHAT_COMPLETIONS, complete, [], run_id="r", model="m", created=5)
    )
    first, second = result["choices"]
    assert first["logprobs"] is None
    assert first["message"]["refusal"] is None
    assert second["logprobs"] == {"c": []}
    assert second["message"]["refusal"] == "no"


def test_a_text_completion_gets_the_edge_id_and_logprobs() -> None:
    provider = {"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}
    complete = Completed(result_json=json.dumps(provider).encode())
    result = json.loads(
        render_result(Operation.COMPLETIONS, complete, [], run_id="r", model="m", created=5)
    )
    assert result["id"] == "cmpl-r"
    assert result["choices"] == [{"index": 0, "text": "a", "logprobs": None}]


def test_embeddings_keep_the_provider_id() -> None:
    provider = {"object": "list", "data": [], "model": "served"}
    complete = Completed(result_json=json.dumps(provider).encode())
    body = render_result(Operation.EMBEDDINGS, complete, [], run_id="r", model="m", created=5)
    assert json.loads(body) == {**provider, "model": "m"}


@pytest.mark.parametrize("operation", [Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS])
def test_with_include_usage_every_chunk_but_the_usage_one_says_null(operation: Operation) -> None:
    stream = ChunkStream(operation, run_id="r", model="m", created=5, include_usage=True)
    chunks = [
        event(stream.delta(Delta(text="a"))),
        event(stream.delta(Delta(text="b"))),  # the token fast path
        event(stream.delta(Delta(text="c", finish_reason="stop"))),
    ]
    end = Completed(usage=Usage(1, 3, 4))
    closing = stream.closing(end)
    # choice 0 said why it ended: no finish chunk, only the usage chunk and [DONE]
    assert closing == stream.usage_chunk(end) + DONE
    last = event(stream.usage_chunk(end))
    assert [chunk["usage"] for chunk in chunks] == [None, None, None]
    assert last["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 3,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_without_include_usage_chunks_have_no_usage_field() -> None:
    stream = ChunkStream(Operation.CHAT_COMPLETIONS, run_id="r", model="m", created=5)
    chunks = [event(stream.delta(Delta(text="a"))), event(stream.delta(Delta(text="b")))]
    assert all("usage" not in chunk for chunk in chunks)


def test_the_providers_streamed_logprobs_reach_the_chunk() -> None:
    logprobs = {"content": [{"token": "b", "logprob": -0.25, "bytes": [98], "top_logprobs": []}]}
    raw = json.dumps(logprobs).encode()
    for operation in (Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS):
        stream = ChunkStream(operation, run_id="r", model="m", created=5)
        stream.delta(Delta(text="a"))
        chunk = event(stream.delta(Delta(text="b", logprobs_json=raw)))  # not the fast path
        (choice,) = chunk["choices"]
        assert choice["logprobs"] == logprobs
        assert choice["finish_reason"] is None
        assert choice.get("text", choice.get("delta", {}).get("content")) == "b"


def test_a_result_only_the_standard_parser_reads_is_rendered_whole() -> None:
    # Python servers write NaN; 2**70 and a cut emoji are legal JSON orjson cannot take.
    raw = b'{"model": "served", "big": 1180591620717411303424, "s": "\\ud83d", "x": NaN}'
    body = render_result(
        Operation.CHAT_COMPLETIONS,
        Completed(result_json=raw),
        [],
        run_id="r",
        model="public",
        created=5,
    )
    assert json.loads(body) == {
        "model": "public",
        "big": 2**70,
        "s": "\ud83d",
        "x": None,
        "id": "chatcmpl-r",
    }


@pytest.mark.parametrize("raw", [b"not json", b"[1]"])
def test_a_broken_provider_result_is_a_provider_failure(raw: bytes) -> None:
    with pytest.raises(ProviderFailed):
        render_result(
            Operation.CHAT_COMPLETIONS,
            Completed(result_json=raw),
            [],
            run_id="r",
            model="m",
            created=5,
        )


def test_embeddings_need_the_provider_result() -> None:
    with pytest.raises(ProviderFailed):
        render_result(Operation.EMBEDDINGS, Completed(), [], run_id="r", model="m", created=5)


def test_a_completion_built_from_deltas() -> None:
    deltas = [Delta(text="Hel"), Delta(text="lo", finish_reason="length")]
    body = render_result(
        Operation.COMPLETIONS, Completed(), deltas, run_id="r", model="m", created=5
    )
    result = json.loads(body)
    assert (result["id"], result["object"], result["model"]) == ("cmpl-r", "text_completion", "m")
    assert result["choices"] == [
        {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}
    ]
    assert result["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_chat_completion_built_from_deltas_has_a_null_refusal() -> None:
    body = render_result(
        Operation.CHAT_COMPLETIONS, Completed(), [Delta(text="x")], run_id="r", model="m", created=5
    )
    (choice,) = json.loads(body)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "x", "refusal": None}
    assert choice["logprobs"] is None
