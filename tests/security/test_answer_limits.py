"""Answers bounded like requests: one output-cap table, and the fields that multiply an answer.

- ``test_every_output_length_an_adapter_reads_is_capped``: every field any node adapter
  reads as an output length (each adapter module's own ``OUTPUT_LENGTH_FIELDS``, found
  through the node's registry of provider types) is in the edge's one table
  (``iop_edge.service.limits.OUTPUT_TOKEN_FIELDS``) for both routes with an output; an
  adapter that starts reading a new field fails it. The OpenAI-compatible engines are
  sent no output length of their own (llama.cpp's ``n_predict`` ...): the edge would
  not see it.
- ``test_max_completion_tokens_on_completions_is_capped``: the hole the table had, on the
  real stack: ``max_completion_tokens`` on ``/v1/completions`` past the model's cap runs
  lowered to it (the mock reads it there), and 2**31 is a 400 naming it.
- ``test_fields_that_multiply_an_answer_are_capped``: ``top_logprobs``, ``n_probs``,
  ``prompt_logprobs``, completions' ``logprobs`` past 20 and ``best_of`` past 1 are a
  400 in OpenAI's shape naming the field, before any slot is taken; at their cap they run.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from iop_edge.domain.fleet import Operation as EdgeOperation
from iop_edge.service.limits import MAX_OUTPUT_TOKENS_ASKED, OUTPUT_TOKEN_FIELDS
from iop_node.bootstrap import ADAPTERS

on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the stack is the module's

CAP = 16  # the fleet's max_output_tokens of "capped"
OUTPUT_ROUTES = (EdgeOperation.CHAT_COMPLETIONS, EdgeOperation.COMPLETIONS)


def test_every_output_length_an_adapter_reads_is_capped() -> None:
    from iop_proto import engine_fields as openai_fields  # the table's test, not the module's

    modules = {sys.modules[factory.__module__] for factory in ADAPTERS.values()}
    assert len(modules) >= 4  # mock, cli, ollama, openai_compat: the registry was read
    for module in sorted(modules, key=lambda m: m.__name__):
        # a module without the constant fails here: each adapter says what it reads
        read = module.OUTPUT_LENGTH_FIELDS
        for route in OUTPUT_ROUTES:
            uncapped = set(read) - set(OUTPUT_TOKEN_FIELDS[route])
            assert not uncapped, f"{module.__name__} reads {uncapped} on {route.value}, uncapped"
    for provider_type, own in openai_fields.ENGINE_FIELDS.items():
        assert not own & openai_fields.ENGINE_OUTPUT_LENGTHS, provider_type
        for operation, fields in openai_fields.OPENAI_FIELDS.items():
            lengths = (fields | own) & (
                set(openai_fields.OUTPUT_LENGTH_FIELDS) | openai_fields.ENGINE_OUTPUT_LENGTHS
            )
            capped = OUTPUT_TOKEN_FIELDS[EdgeOperation(operation)]
            assert lengths <= set(capped), (provider_type, operation, lengths)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    mock = {
        "id": "node-a-capped",
        "type": "mock",
        "category": "local_inference",
        "models": ["capped-a"],
        "capacity": 2,
        "max_queue": 4,
        "queue_timeout_ms": 10_000,
        "request_timeout_ms": 30_000,
        "tokens_per_second": 100_000,  # a run past the cap ends fast, and shows its length
    }
    fleet = {
        "models": [
            {"id": "capped", "max_output_tokens": CAP, "providers": {"node-a-capped": "capped-a"}}
        ],
        "nodes": [{"id": "node-a", "providers": [mock]}, {"id": "node-b", "providers": []}],
    }
    root = Path(tmp_path_factory.mktemp("answer-limits"))
    async with start_stack_factory(root, fleet) as running:
        yield running


async def post(stack: Any, path: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.api_url}/{path}", json=body) as r:
            return r.status, await r.json(), dict(r.headers)


@on_module_loop
async def test_max_completion_tokens_on_completions_is_capped(stack: Any) -> None:
    body = {"model": "capped", "prompt": "Count to a thousand:", "max_completion_tokens": 6000}
    status, answer, headers = await post(stack, "completions", body)
    assert status == 200, answer
    assert headers.get("x-iop-max-tokens-clamped") == f"6000->{CAP}"
    assert 0 < answer["usage"]["completion_tokens"] <= CAP  # the mock read the lowered value
    assert answer["choices"][0]["finish_reason"] == "length"

    huge = {**body, "max_completion_tokens": MAX_OUTPUT_TOKENS_ASKED + 1}
    status, answer, _ = await post(stack, "completions", huge)
    assert status == 400, answer
    assert answer["error"]["param"] == "max_completion_tokens"
    assert answer["error"]["code"] == "integer_above_max_value"


@on_module_loop
@pytest.mark.parametrize(
    ("path", "field", "over", "cap"),  # the caps docs/ARCHITECTURE.md gives
    [
        ("chat/completions", "top_logprobs", 21, 20),
        ("chat/completions", "n_probs", 100_000, 20),
        ("chat/completions", "prompt_logprobs", 21, 20),
        ("completions", "logprobs", 21, 20),
        ("completions", "n_probs", 21, 20),
        ("completions", "best_of", 2, 1),
    ],
)
async def test_fields_that_multiply_an_answer_are_capped(
    stack: Any, path: str, field: str, over: int, cap: int
) -> None:
    if path == "completions":
        base: dict[str, Any] = {"model": "capped", "prompt": "hi", "max_tokens": 2}
    else:
        messages = [{"role": "user", "content": "hi"}]
        base = {"model": "capped", "messages": messages, "max_tokens": 2}
    status, answer, _ = await post(stack, path, {**base, field: over})
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        field,
        "integer_above_max_value",
    )
    assert f"<= {cap}" in error["message"]

    status, answer, _ = await post(stack, path, {**base, field: "many"})
    assert status == 400, answer
    assert answer["error"]["param"] == field

    status, answer, _ = await post(stack, path, {**base, field: cap})
    assert status == 200, answer


@on_module_loop
async def test_chat_logprobs_stays_a_switch(stack: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "capped", "messages": messages, "logprobs": True, "top_logprobs": 20}
    status, answer, _ = await post(stack, "chat/completions", body)
    assert status == 200, answer
