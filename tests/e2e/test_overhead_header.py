"""``x-iop-overhead-ms`` and ``iop_edge_overhead_seconds`` on a real stack (control-plane, edge,
two nodes with mock providers).

Every response of the inference routes says what the edge and the node spent on it,
the provider's time excluded (for a stream: up to its first byte), and the edge's
metrics count the same values. Only behaviour is checked: the header is there, a
number, not negative, and below the time the client itself waited; never how large.
"""

from __future__ import annotations

import re
import time
from typing import Any

import aiohttp
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # the `stack` fixture of conftest.py (a conftest cannot be imported)
HEADER = "x-iop-overhead-ms"
MODEL = "mock-small"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ROUTES: list[tuple[str, dict[str, Any], str]] = [
    ("/chat/completions", CHAT, "chat_completions"),
    ("/completions", {"model": MODEL, "prompt": "once", "max_tokens": 3}, "completions"),
    ("/embeddings", {"model": MODEL, "input": ["a", "b"]}, "embeddings"),
    # the Responses and Messages APIs run as chat completions (the run log's operation too)
    ("/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3}, "chat_completions"),
    ("/messages", CHAT, "chat_completions"),
]
STREAMED = [(path, body, op) for path, body, op in ROUTES if path != "/embeddings"]


async def _post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, float, float]:
    """(status, the header's value, what the client waited in ms), the body read whole."""
    async with aiohttp.ClientSession() as http:
        began = time.perf_counter()
        async with http.post(stack.api_url + path, json=body) as response:
            await response.read()
            waited_ms = (time.perf_counter() - began) * 1000
            value = response.headers.get(HEADER)
            assert value is not None, f"{path}: no {HEADER} in {dict(response.headers)}"
            return response.status, float(value), waited_ms


async def _overhead_counts(stack: Stack) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.edge_admin}/metrics") as response:
            text = await response.text()
    pattern = r'^iop_edge_overhead_seconds_count\{operation="([^"]+)",stream="([^"]+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.mark.parametrize(("path", "body", "operation"), ROUTES)
async def test_non_streamed_answers_carry_the_overhead(
    stack: Stack, path: str, body: dict[str, Any], operation: str
) -> None:
    before = await _overhead_counts(stack)
    status, overhead_ms, waited_ms = await _post(stack, path, body)
    assert status == 200
    assert 0 <= overhead_ms < waited_ms
    after = await _overhead_counts(stack)
    grown = {k for k, v in after.items() if v > before.get(k, 0.0)}
    assert grown == {(operation, "false")}, (before, after)


@pytest.mark.parametrize(("path", "body", "operation"), STREAMED)
async def test_streams_carry_the_overhead_to_their_first_byte(
    stack: Stack, path: str, body: dict[str, Any], operation: str
) -> None:
    before = await _overhead_counts(stack)
    status, overhead_ms, waited_ms = await _post(stack, path, {**body, "stream": True})
    assert status == 200
    assert 0 <= overhead_ms < waited_ms
    after = await _overhead_counts(stack)
    grown = {k for k, v in after.items() if v > before.get(k, 0.0)}
    assert grown == {(operation, "true")}, (before, after)


async def test_a_request_the_edge_refuses_carries_the_overhead_too(stack: Stack) -> None:
    status, overhead_ms, waited_ms = await _post(
        stack, "/chat/completions", {**CHAT, "model": "no-such-model"}
    )
    assert status == 404
    assert 0 <= overhead_ms < waited_ms
