"""The Responses event writer, checked without a server: OpenAI's event order, the fields of
each event, the whole Response at the end, and the token fast path against the general one."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from iop_edge.domain.events import Completed, Delta, ToolCallDelta, Usage
from iop_edge.errors import ProviderFailed
from iop_edge.formats.responses_output import OutputShape
from iop_edge.formats.responses_request import read_request
from iop_edge.formats.responses_stream import ResponseEventStream

ECHO = read_request({"model": "m", "input": "hi", "stream": True}).echo
NOW = 1_700_000_000.5


def clock() -> float:
    return NOW


def events(raw: bytes) -> list[dict[str, Any]]:
    """Each SSE event of ``raw``: its ``event:`` line must name the data's type."""
    out = []
    for frame in raw.split(b"\n\n"):
        if not frame:
            continue
        head, data = frame.split(b"\n")
        assert head.startswith(b"event: ")
        assert data.startswith(b"data: ")
        payload: dict[str, Any] = json.loads(data[len(b"data: ") :])
        assert payload["type"] == head[len(b"event: ") :].decode()
        out.append(payload)
    return out


def run(deltas: list[Delta], end: Completed) -> tuple[list[dict[str, Any]], ResponseEventStream]:
    stream = ResponseEventStream(ECHO, "r1", 7, OutputShape(), clock)
    raw = stream.opening() + b"".join(stream.delta(d) for d in deltas) + stream.closing(end)
    got = events(raw)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    return got, stream


def test_a_text_answer_streams_in_openai_order() -> None:
    got, stream = run(
        [Delta(text="Hel", role="assistant"), Delta(text="lo"), Delta(finish_reason="stop")],
        Completed("stop", Usage(3, 2, 5)),
    )
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert got[0]["response"]["status"] == "in_progress"
    assert got[0]["response"]["id"] == "resp_r1"
    assert got[2]["item"] == {
        "id": "msg_r1",
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert [e["delta"] for e in got[4:6]] == ["Hel", "lo"]
    assert got[6]["text"] == "Hello"
    final = got[-1]["response"]
    assert final == stream.final
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 3
    assert final["usage"]["total_tokens"] == 5


@given(st.text(min_size=1))
def test_the_token_fast_path_writes_what_the_general_path_would(text: str) -> None:
    fast = ResponseEventStream(ECHO, "r", 1, OutputShape(), clock)
    slow = ResponseEventStream(ECHO, "r", 1, OutputShape(), clock)
    fast.delta(Delta(text="a"))
    slow.delta(Delta(text="a"))
    quick = events(fast.delta(Delta(text=text)))
    general = events(slow.delta(Delta(text=text, usage=Usage())))  # usage: not the fast path
    assert quick == general


def test_reasoning_then_text_then_tool_calls_are_separate_items() -> None:
    got, stream = run(
        [
            Delta(reasoning_text="think"),
            Delta(text="ok"),
            Delta(tool_calls=(ToolCallDelta(0, id="call_a", function_name="f"),)),
            Delta(tool_calls=(ToolCallDelta(0, function_arguments='{"x":'),)),
            Delta(tool_calls=(ToolCallDelta(0, function_arguments="1}"),)),
            Delta(
                tool_calls=(
                    ToolCallDelta(1, id="call_b", function_name="g", function_arguments="{}"),
                )
            ),
        ],
        Completed("tool_calls"),
    )
    kinds = [e["type"] for e in got]
    assert kinds[2:9] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    calls = [e for e in got if e["type"] == "response.function_call_arguments.done"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"x":1}'), ("g", "{}")]
    added = [e["item"] for e in got if e["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == ["reasoning", "message", "function_call", "function_call"]
    assert added[2]["call_id"] == "call_a"
    assert added[2]["name"] == "f"
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [
        0,
        1,
        2,
        3,
    ]
    output = got[-1]["response"]["output"]
    assert [i["id"] for i in output] == ["rs_r1", "msg_r1", "fc_r1_0", "fc_r1_1"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert stream.final is not None
    assert stream.final["status"] == "completed"


def test_length_ends_incomplete_with_max_output_tokens() -> None:
    got, _ = run([Delta(text="a b")], Completed("length", Usage(1, 2, 3)))
    assert got[-1]["type"] == "response.incomplete"
    final = got[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_a_run_that_said_nothing_still_answers_with_an_empty_message() -> None:
    got, _ = run([], Completed("stop"))
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_failure_after_the_first_byte_ends_with_error_and_response_failed() -> None:
    stream = ResponseEventStream(ECHO, "r1", 7, OutputShape(), clock)
    stream.opening()
    stream.delta(Delta(text="par"))
    got = events(stream.failure(ProviderFailed("boom")))
    assert [e["type"] for e in got] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert got[3]["message"] == "boom"
    assert got[3]["code"] == "provider_error"
    failed = got[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "boom"}
    assert failed["output"][0]["status"] == "incomplete"


def test_usage_a_delta_carried_is_the_response_s_when_the_end_has_none() -> None:
    got, _ = run([Delta(text="a"), Delta(finish_reason="stop", usage=Usage(4, 1, 5))], Completed())
    assert got[-1]["response"]["usage"]["input_tokens"] == 4
    assert got[-1]["response"]["usage"]["total_tokens"] == 5


def test_items_of_a_kind_that_comes_back_get_ids_of_their_own() -> None:
    got, _ = run(
        [
            Delta(reasoning_text="a"),
            Delta(text="b"),
            Delta(reasoning_text="c"),
            Delta(text="d"),
        ],
        Completed("stop"),
    )
    ids = [item["id"] for item in got[-1]["response"]["output"]]
    assert ids == ["rs_r1", "msg_r1", "rs_r1_2", "msg_r1_3"]
