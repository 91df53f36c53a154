"""``RunBody``: the body serialised once and completed for the chosen provider's type; what
an OpenAI-compatible engine gets is exactly what the node would have prepared from the
client's body (``iop_proto.engine_fields.provider_body``), and it fits the frame bound
measured before any slot was taken."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.domain.fleet import Operation
from iop_edge.service.limits import RUN_FRAME_OVERHEAD, SWITCHES_SLACK, RunBody
from iop_proto import json_codec
from iop_proto.engine_fields import provider_body
from iop_proto.prefix import body_blocks

LONG = [{"role": "user", "content": "a question that spans blocks " * 40}]
BODIES: list[dict[str, Any]] = [
    {"model": "public", "messages": LONG},
    {"model": "public", "messages": LONG, "stream": True, "temperature": 0.5},
    {"messages": [], "stream_options": {"continuous_usage_stats": True}, "stream": True},
    {"model": "m", "messages": [], "stream_options": "not an object", "big": 2**70},
    {"model": "m", "messages": [], "top_k": 5, "n_predict": 10},  # engines' own fields
    {"model": "m", "prompt": "p" * 600, "max_tokens": 3},
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("provider_type", ["vllm", "llamacpp", "openai_api", "sglang"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prepared_body_is_what_the_node_would_send(
    body: dict[str, Any], provider_type: str, stream: bool
) -> None:
    operation = Operation.COMPLETIONS if "prompt" in body else Operation.CHAT_COMPLETIONS
    run_body = RunBody(body, ["served/é"])
    sent, prepared, blocks = run_body.for_provider(provider_type, "served/é", operation, stream)
    named = {**body, "model": "served/é"}
    assert prepared is True
    assert json_codec.loads(sent) == provider_body(named, provider_type, operation, stream)
    assert blocks == tuple(body_blocks(body))
    # the frame's bound: the body, the served name again, the rest of the frame
    assert len(sent) + len("served/é".encode()) + RUN_FRAME_OVERHEAD <= run_body.frame_bytes
    assert json_codec.loads(sent)["model"] == "served/é"
    assert body.get("model") != "served/é"  # the client's body is never changed


def test_other_provider_types_get_the_clients_body_with_the_served_name() -> None:
    body = {"model": "public", "messages": [], "stream": True, "x_vendor": 1}
    run_body = RunBody(body, ["served"])
    sent, prepared, blocks = run_body.for_provider(
        "mock", "served", Operation.CHAT_COMPLETIONS, True
    )
    assert (prepared, blocks) == (False, ())
    assert json_codec.loads(sent) == {**body, "model": "served"}
    # measured exactly: what was sent, the name again, the switches' slack, the frame's rest
    bound = len(sent) + len(b"served") + SWITCHES_SLACK + RUN_FRAME_OVERHEAD
    assert run_body.frame_bytes == bound


def test_count_tokens_is_never_prepared() -> None:
    body = {"model": "public", "messages": [], "top_k": 1}
    sent, prepared, _ = RunBody(body).for_provider("vllm", "s", Operation.COUNT_TOKENS, False)
    assert prepared is False
    assert json_codec.loads(sent) == {**body, "model": "s"}


def test_embeddings_are_prepared_without_streaming_switches() -> None:
    body = {"model": "public", "input": "x", "stream": False, "user": "u"}
    sent, prepared, blocks = RunBody(body).for_provider("vllm", "s", Operation.EMBEDDINGS, False)
    assert (prepared, blocks) == (True, ())
    assert json_codec.loads(sent) == {"model": "s", "input": "x", "user": "u"}


def test_the_prompt_is_hashed_once_for_every_attempt() -> None:
    run_body = RunBody({"model": "m", "messages": LONG})
    first = run_body.prompt_blocks()
    assert first
    assert run_body.prompt_blocks() is first
