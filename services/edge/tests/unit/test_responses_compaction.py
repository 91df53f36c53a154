"""``formats.responses_compaction``: the summary's chat body, the compaction item and its
way back in as context, and the stream of a compaction turn."""

from __future__ import annotations

import json

from iop_edge.domain.events import Completed, Delta, Usage
from iop_edge.errors import ProviderFailed
from iop_edge.formats.responses_compaction import (
    SUMMARY_HEADER,
    CompactionEvents,
    asks_compaction,
    compaction_context,
    compaction_item,
    summary_body,
)
from iop_edge.formats.responses_request import chat_body, read_request


def test_a_compaction_item_comes_back_as_its_summary() -> None:
    item = compaction_item("cmp_1", "Ada fixes parser.py; KeyError in read_header.")
    assert item["type"] == "compaction"
    assert "Ada" not in item["encrypted_content"]  # opaque to the client, as specified
    assert compaction_context(item) == {
        "role": "user",
        "content": f"{SUMMARY_HEADER}\nAda fixes parser.py; KeyError in read_header.",
    }


def test_a_foreign_or_broken_compaction_item_is_left_out() -> None:
    assert compaction_context({"type": "compaction", "encrypted_content": "gAAAAB..."}) is None
    broken = {"type": "compaction", "encrypted_content": "iop-compaction-v1:%%%"}
    assert compaction_context(broken) is None


def test_a_request_reads_compaction_items_as_context() -> None:
    item = compaction_item("cmp_1", "the summary")
    request = read_request(
        {
            "model": "m",
            "input": [
                {"type": "compaction_summary", "encrypted_content": "foreign"},
                item,
                {"role": "user", "content": "next"},
            ],
        }
    )
    assert chat_body(request, ())["messages"] == [
        {"role": "user", "content": f"{SUMMARY_HEADER}\nthe summary"},
        {"role": "user", "content": "next"},
    ]


def test_the_summary_body_is_one_transcript() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "weather", "arguments": '{"city":"Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = summary_body("m", messages, None, stream=True)
    assert body["max_tokens"] == 1024
    assert body["stream"] is True
    system, user = body["messages"]
    assert system["role"] == "system"
    assert user["content"] == (
        "The conversation:\n\nSystem: be brief\n\nUser: weather?\n\n"
        'Assistant called weather with {"city":"Paris"}\n\nTool result (c1): sunny'
        "\n\nWrite the summary now."
    )
    assert "stream" not in summary_body("m", messages, 7, stream=False)


def test_a_trigger_asks_for_a_compaction_only_last() -> None:
    trigger = {"type": "compaction_trigger"}
    assert asks_compaction({"input": [{"role": "user", "content": "x"}, trigger]})
    assert not asks_compaction({"input": [trigger, {"role": "user", "content": "x"}]})
    assert not asks_compaction({"input": "compaction_trigger"})


def events(raw: bytes) -> list[dict[str, object]]:
    return [json.loads(frame.split(b"\ndata: ")[1]) for frame in raw.split(b"\n\n") if frame]


def test_a_compaction_turn_streams_one_compaction_item() -> None:
    stream = CompactionEvents({"model": "m"}, "r1", 5)
    raw = stream.opening()
    assert stream.delta(Delta(text="the ", role="assistant")) == b""
    raw += stream.delta(Delta(text="summary"))
    raw += stream.closing(Completed("stop", Usage(10, 2, 12)))
    out = events(raw)
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == [0, 1, 2, 3, 4]
    final = out[-1]["response"]
    assert isinstance(final, dict)
    (item,) = final["output"]
    assert item["id"] == "cmp_r1"
    assert compaction_context(item) == {"role": "user", "content": f"{SUMMARY_HEADER}\nthe summary"}
    assert final["usage"]["output_tokens"] == 2


def test_a_failed_compaction_turn_ends_with_response_failed() -> None:
    stream = CompactionEvents({"model": "m"}, "r1", 5)
    out = events(stream.opening() + stream.failure(ProviderFailed("engine gone")))
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
