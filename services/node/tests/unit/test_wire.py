"""wire: the node's run events as the edge receives them."""

from __future__ import annotations

import json

from iop_node.domain.cache_account import CacheView
from iop_node.domain.events import Failed, Started
from iop_node.domain.runs import Completion, Delta, ToolCallDelta, Usage
from iop_node.entrypoints import wire
from iop_node.errors import ErrorCode
from iop_proto.v1 import runtime_pb2 as pb


def test_a_text_delta_carries_only_its_text() -> None:
    event = wire.run_event(Delta(text="x "))
    assert event.WhichOneof("kind") == "delta"
    assert event.delta == pb.RunDelta(text="x ")
    assert (
        event.SerializeToString() == pb.RunEvent(delta=pb.RunDelta(text="x ")).SerializeToString()
    )


def test_an_empty_delta_is_still_a_delta() -> None:
    assert wire.run_event(Delta()).WhichOneof("kind") == "delta"


def test_every_field_of_a_delta_arrives() -> None:
    delta = Delta(
        text="t",
        role="assistant",
        choice_index=2,
        tool_calls=(
            ToolCallDelta(0, "call_1", "function", "get_weather", '{"ci'),
            ToolCallDelta(1, function_arguments='ty"}'),
        ),
        finish_reason="tool_calls",
        reasoning_text="hmm",
        usage=Usage(3, 4, 7),
    )
    expected = pb.RunDelta(
        choice_index=2,
        role="assistant",
        text="t",
        finish_reason="tool_calls",
        reasoning_text="hmm",
        usage=pb.Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7),
        tool_calls=[
            pb.ToolCallDelta(
                index=0,
                id="call_1",
                type="function",
                function_name="get_weather",
                function_arguments='{"ci',
            ),
            pb.ToolCallDelta(index=1, function_arguments='ty"}'),
        ],
    )
    assert wire.run_event(delta).delta == expected


def test_the_provider_result_bytes_are_forwarded_untouched() -> None:
    raw = b'{\n  "object": "chat.completion",  "choices": []\n}\n'
    completion = Completion("stop", Usage(1, 2, 3), json.loads(raw), result_json=raw)
    event = wire.run_event(completion)
    assert event.complete == pb.RunComplete(
        finish_reason="stop",
        usage=pb.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
        result_json=raw,
    )


def test_a_result_without_its_bytes_is_encoded_compactly() -> None:
    completion = Completion("stop", None, {"object": "list", "data": ["é"]})
    complete = wire.run_event(completion).complete
    assert complete.result_json == '{"object":"list","data":["é"]}'.encode()
    assert not complete.HasField("usage")


def test_a_streamed_run_completes_without_a_result() -> None:
    event = wire.run_event(Completion("length", Usage(5, 16, 21)))
    assert event.WhichOneof("kind") == "complete"
    assert event.complete.result_json == b""
    assert event.complete.usage.total_tokens == 21


def test_a_first_delta_carries_its_wait_on_the_provider() -> None:
    assert wire.run_event(Delta(text="x", provider_us=1500)).delta.provider_us == 1500


def test_a_start_carries_its_provider_and_queue_wait() -> None:
    event = wire.run_event(Started("p1", "served", 12))
    assert event.start == pb.RunStart(provider_id="p1", target="served", queue_wait_ms=12)


def test_a_failure_carries_its_code_numbers_and_load() -> None:
    failure = Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", 400, 7, 4096, 5000)
    cache = CacheView(((9, 2),), 100, 40, None)
    event = wire.run_event(failure, wire.provider_load(1, 2, cache))
    assert event.error == pb.RunError(
        code=pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
        message="too long",
        provider_status=400,
        provider_us=7,
        context_window=4096,
        prompt_tokens=5000,
        load=pb.ProviderLoad(
            in_flight=1,
            queued=2,
            cache=pb.CacheState(
                prefixes=[pb.CachedPrefix(tail=9, blocks=2)], prompt_tokens=100, cached_tokens=40
            ),
        ),
    )


def test_a_completion_carries_the_load_it_is_given() -> None:
    event = wire.run_event(Completion("stop"), wire.provider_load(0, 0, CacheView()))
    assert event.complete.HasField("load")
    assert not event.complete.HasField("usage")
