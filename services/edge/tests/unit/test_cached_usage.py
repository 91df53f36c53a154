"""Cached prompt tokens in every API's usage, streamed and not, checked without a server.

The node reports them in the run's ``Usage.cached_tokens`` (llama.cpp's ``timings.cache_n``
or an OpenAI-compatible ``prompt_tokens_details.cached_tokens``); a non-streamed run also
forwards the engine's own result, which may say the same, less, or nothing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import run_event
from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.events import Completed, Delta, Usage
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.formats.anthropic import MessageStream, render_message, usage_body
from iop_edge.formats.openai import ChunkStream, render_result
from iop_edge.formats.responses_output import OutputShape, Turn
from iop_edge.formats.responses_request import read_request
from iop_edge.formats.responses_stream import ResponseEventStream
from iop_edge.metrics import EdgeMetrics
from iop_edge.service.catalog import PoolCatalog
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_proto.v1 import runtime_pb2 as pb

CACHED = Usage(prompt_tokens=100, completion_tokens=5, total_tokens=105, cached_tokens=64)


def chat_result(usage: dict[str, Any] | None, operation: Operation) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    if operation is Operation.CHAT_COMPLETIONS:
        choice["message"] = {"role": "assistant", "content": "hi"}
    else:
        choice["text"] = "hi"
    result: dict[str, Any] = {"id": "x", "model": "served", "choices": [choice]}
    if usage is not None:
        result["usage"] = usage
    return json.dumps(result).encode()


def result_end(
    engine_says: dict[str, int] | None,
    node_says: int,
    operation: Operation = Operation.CHAT_COMPLETIONS,
) -> Completed:
    """A run that ended with the engine's result: its usage with ``engine_says`` as
    ``prompt_tokens_details`` (``None``: left out), the node's own count ``node_says``."""
    usage: dict[str, Any] = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
    if engine_says is not None:
        usage["prompt_tokens_details"] = engine_says
    return Completed(
        finish_reason="stop",
        usage=Usage(100, 5, 105, node_says),
        result_json=chat_result(usage, operation),
    )


def sse_json(raw: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[len(b"data: ") :])
        for line in raw.split(b"\n")
        if line.startswith(b"data: {")
    ]


def test_the_wire_s_cached_tokens_reach_the_edge_s_usage() -> None:
    usage = pb.Usage(prompt_tokens=100, completion_tokens=5, total_tokens=105, cached_tokens=64)
    event = run_event(pb.RunEvent(complete=pb.RunComplete(finish_reason="stop", usage=usage)))
    assert isinstance(event, Completed)
    assert event.usage == CACHED


# ------------------------------------------------------------------ OpenAI


@pytest.mark.parametrize("operation", [Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS])
def test_openai_s_streamed_usage_chunk_names_the_cached_tokens(operation: Operation) -> None:
    stream = ChunkStream(operation, run_id="r", model="m", created=5, include_usage=True)
    (chunk,) = sse_json(stream.usage_chunk(Completed(usage=CACHED)))
    assert chunk["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "total_tokens": 105,
        "prompt_tokens_details": {"cached_tokens": 64},
    }


@pytest.mark.parametrize("operation", [Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS])
@pytest.mark.parametrize(
    ("engine_says", "node_says", "shown"),
    [
        ({"cached_tokens": 64}, 64, 64),  # a newer llama.cpp: both agree
        (None, 64, 64),  # an older llama.cpp: only its timings (read by the node) tell
        ({"cached_tokens": 80}, 0, 80),  # the engine's word when the node counted none
        ({"cached_tokens": 64, "audio_tokens": 0}, 64, 64),  # the engine's other details kept
        (None, 0, 0),  # an engine that says nothing: 0
    ],
)
def test_openai_s_forwarded_result_carries_the_larger_count(
    operation: Operation, engine_says: dict[str, int] | None, node_says: int, shown: int
) -> None:
    end = result_end(engine_says, node_says, operation)
    result = json.loads(render_result(operation, end, [], run_id="r", model="m", created=5))
    assert result["usage"]["prompt_tokens_details"] == {
        **(engine_says or {}),
        "cached_tokens": shown,
    }
    assert result["usage"]["prompt_tokens"] == 100


def test_openai_s_result_without_usage_gets_the_node_s() -> None:
    end = Completed(usage=CACHED, result_json=chat_result(None, Operation.CHAT_COMPLETIONS))
    result = json.loads(
        render_result(Operation.CHAT_COMPLETIONS, end, [], run_id="r", model="m", created=5)
    )
    assert result["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


def test_openai_s_result_built_from_deltas_names_the_cached_tokens() -> None:
    body = render_result(
        Operation.CHAT_COMPLETIONS,
        Completed(usage=CACHED),
        [Delta(text="hi")],
        run_id="r",
        model="m",
        created=5,
    )
    assert json.loads(body)["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


def test_openai_s_embeddings_are_left_as_the_provider_sent_them() -> None:
    provider = {"object": "list", "data": [], "usage": {"prompt_tokens": 3, "total_tokens": 3}}
    end = Completed(usage=CACHED, result_json=json.dumps(provider).encode())
    body = render_result(Operation.EMBEDDINGS, end, [], run_id="r", model="m", created=5)
    assert json.loads(body)["usage"] == provider["usage"]


# ------------------------------------------------------------------ Anthropic


def test_anthropic_s_input_tokens_are_those_not_read_from_the_cache() -> None:
    assert usage_body(CACHED) == {
        "input_tokens": 36,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
    }
    assert usage_body(None)["cache_read_input_tokens"] == 0
    # a count past the prompt (a confused engine) never makes input_tokens negative
    assert usage_body(Usage(10, 1, 11, 12))["input_tokens"] == 0


def test_anthropic_s_stream_tells_the_cache_in_message_delta() -> None:
    stream = MessageStream(message_id="msg_r", model="m")
    raw = (
        stream.opening() + stream.delta(Delta(text="hi")) + stream.closing(Completed(usage=CACHED))
    )
    payloads = sse_json(raw)
    start = next(p for p in payloads if p["type"] == "message_start")
    delta = next(p for p in payloads if p["type"] == "message_delta")
    assert start["message"]["usage"]["cache_read_input_tokens"] == 0  # not known yet
    assert delta["usage"] == {
        "input_tokens": 36,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
    }


@pytest.mark.parametrize(
    ("engine_says", "node_says", "read"),
    [(None, 64, 64), ({"cached_tokens": 64}, 0, 64), (None, 0, 0)],
)
def test_anthropic_s_message_from_a_chat_result_tells_the_cache(
    engine_says: dict[str, int] | None, node_says: int, read: int
) -> None:
    end = result_end(engine_says, node_says)
    message = render_message(end, [], message_id="msg_r", model="m")
    assert message["usage"]["cache_read_input_tokens"] == read
    assert message["usage"]["input_tokens"] == 100 - read


def test_anthropic_s_message_from_deltas_tells_the_cache() -> None:
    message = render_message(Completed(usage=CACHED), [Delta(text="hi")], message_id="m", model="m")
    assert (message["usage"]["input_tokens"], message["usage"]["cache_read_input_tokens"]) == (
        36,
        64,
    )


# ------------------------------------------------------------------ Responses


def test_responses_stream_tells_the_cache_in_the_completed_response() -> None:
    echo = read_request({"model": "m", "input": "hi", "stream": True}).echo
    stream = ResponseEventStream(echo, "r1", 7, OutputShape(), lambda: 1.0)
    raw = (
        stream.opening() + stream.delta(Delta(text="hi")) + stream.closing(Completed(usage=CACHED))
    )
    completed = [p for p in sse_json(raw) if p["type"] == "response.completed"]
    usage = completed[0]["response"]["usage"]
    assert usage["input_tokens"] == 100
    assert usage["input_tokens_details"]["cached_tokens"] == 64


@pytest.mark.parametrize(
    ("engine_says", "node_says", "shown"),
    [(None, 64, 64), ({"cached_tokens": 80}, 64, 80), (None, 0, 0)],
)
def test_responses_answer_tells_the_larger_count(
    engine_says: dict[str, int] | None, node_says: int, shown: int
) -> None:
    end = result_end(engine_says, node_says)
    turn = Turn.of_run(end, [])
    assert turn.usage_object()["input_tokens_details"]["cached_tokens"] == shown


# ------------------------------------------------------------------ the catalog


def test_the_catalog_shows_each_provider_s_hit_rate_null_before_any_report() -> None:
    dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()))
    providers = {
        pid: ProviderEntry(pid, "n1", "mock", "local_inference", ("s",), 2, 4, 1000, 1000)
        for pid in ("p-a", "p-b")
    }
    model = ModelEntry("m", "M", {pid: "s" for pid in providers})
    dispatcher.pool.apply_fleet(Fleet(version=1, models={"m": model}, providers=providers))
    slot = dispatcher.pool.slot("p-a")
    assert slot is not None
    slot.cache = CacheReport(prompt_tokens=300, cached_tokens=100)  # as a snapshot fills it
    catalog = PoolCatalog(dispatcher.fleet, dispatcher.pool, dispatcher)

    views = {v["provider_id"]: v["cache"] for v in catalog.provider_views()}
    assert views == {
        "p-a": {"hit_rate": 0.3333, "prompt_tokens": 300, "cached_tokens": 100},
        "p-b": {"hit_rate": None, "prompt_tokens": 0, "cached_tokens": 0},
    }
