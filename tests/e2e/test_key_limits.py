"""Limits per key on a real stack (control-plane, edge, two nodes with mock providers),
issued with the control-plane's CLI (docs/ARCHITECTURE.md#limits-per-key).

Four keys: one with requests per minute, two with output tokens per minute (one
streamed, one not), one with a daily token budget. Each is driven past its limit; the
answers' rate-limit headers must say what the limiter holds (counted here from what
the requests were, and from the usage the answers report), and the refusals must be
429s in the API's own shape, with ``Retry-After``. The mock answers ``max_tokens``
words, and counts the prompt's words as its input tokens.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from multidict import CIMultiDict

from iop_edge.service.key_rates import estimate_input_tokens

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any  # conftest's ``stack``
MODEL = "mock-small"


def chat(max_tokens: int, *, stream: bool = False, words: str = "hi") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": max_tokens,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def post(
    stack: Stack, secret: str, body: dict[str, Any], path: str = "/chat/completions"
) -> tuple[int, CIMultiDict[str], bytes]:
    headers = {"Authorization": f"Bearer {secret}"}
    if path == "/messages":
        headers = {"x-api-key": secret, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.api_url + path, json=body, headers=headers) as answer:
            return answer.status, answer.headers.copy(), await answer.read()


def streamed_tokens(raw: bytes) -> int:
    """The content chunks of an OpenAI stream (the mock sends one token each)."""
    count = 0
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                count += bool(choice.get("delta", {}).get("content"))
    return count


async def test_requests_per_minute_hold_and_the_headers_count_down(stack: Stack) -> None:
    secret = await stack.issue_key("rpm", "--rpm", "4")
    remaining = []
    for _ in range(4):
        status, headers, _ = await post(stack, secret, chat(2))
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "4"
        remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert remaining == [3, 2, 1, 0]

    status, headers, raw = await post(stack, secret, chat(2))
    assert status == 429
    error = json.loads(raw)["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert 1 <= int(headers["Retry-After"]) <= 61
    assert headers["x-ratelimit-remaining-requests"] == "0"

    # The Messages API: Anthropic's error and headers for the same key's state.
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, headers, raw = await post(stack, secret, messages, "/messages")
    assert status == 429
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    assert 1 <= int(headers["retry-after"]) <= 61
    assert headers["anthropic-ratelimit-requests-limit"] == "4"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")

    # The official SDK reads it as a rate limit (its retries honour Retry-After).
    client = openai.AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(**chat(2))
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    await client.close()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
async def test_output_tokens_per_minute_hold_and_a_stream_past_them_finishes(
    stack: Stack, stream: bool
) -> None:
    secret = await stack.issue_key(f"otpm-{stream}", "--output-tpm", "60")
    shown = []
    for _ in range(3):  # 25 tokens each: the third is admitted with 10 left, and finishes
        status, headers, raw = await post(stack, secret, chat(25, stream=stream))
        assert status == 200
        shown.append(int(headers["x-ratelimit-remaining-tokens"]))
        if stream:
            assert streamed_tokens(raw) == 25
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] == 25
    assert shown == [60, 35, 10]  # what was left when each was admitted
    status, headers, raw = await post(stack, secret, chat(25, stream=stream))
    assert status == 429
    error = json.loads(raw)["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "60"
    assert 1 <= int(headers["Retry-After"]) <= 61


async def test_a_budget_stops_the_key_at_its_periods_limit(stack: Stack) -> None:
    budget = 150
    secret = await stack.issue_key("budget", "--budget", str(budget), "--budget-period", "day")
    body = chat(20, words="one two three four")
    estimate = estimate_input_tokens(body)
    used = 0
    for _ in range(20):
        status, headers, raw = await post(stack, secret, body)
        if status != 200:
            break
        # The standing once admitted: what the earlier requests used, this one's estimate.
        assert int(headers["x-iop-budget-remaining"]) == budget - used - estimate
        assert headers["x-iop-budget-limit"] == str(budget)
        usage = json.loads(raw)["usage"]
        used += usage["prompt_tokens"] + usage["completion_tokens"]
    assert status == 429
    error = json.loads(raw)["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert int(headers["Retry-After"]) <= 86_400  # the day's end
    assert headers["x-iop-budget-remaining"] == "0"
    assert budget <= used < budget + 24  # stopped at the budget: one request past it at most


async def test_a_key_without_limits_gets_no_rate_limit_headers(stack: Stack) -> None:
    secret = await stack.issue_key("free")
    for _ in range(6):
        status, headers, _ = await post(stack, secret, chat(2))
        assert status == 200
        assert not [name for name in headers if "ratelimit" in name.lower()]


async def test_batch_lines_count_in_their_owners_budget(stack: Stack) -> None:
    """A batch's lines count their tokens in the owner's budget (not its rates): once
    it is used up, the remaining lines fail with ``insufficient_quota``, and the key's
    next interactive request is refused the same way."""
    budget, lines = 120, 12  # each line: 2 prompt words, 20 answer words
    secret = await stack.issue_key("batch-budget", "--budget", str(budget), "--rpm", "1")
    async with openai.AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0) as sdk:
        body = b"".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": chat(20, words=f"line {i}"),
                }
            ).encode()
            + b"\n"
            for i in range(lines)
        )
        upload = await sdk.files.create(file=("batch.jsonl", body), purpose="batch")
        batch = await sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with asyncio.timeout(120):
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                await asyncio.sleep(0.2)
                batch = await sdk.batches.retrieve(batch.id)
        assert batch.status == "completed"
        done = (await sdk.files.content(batch.output_file_id or "")).text.splitlines()
        failed = (await sdk.files.content(batch.error_file_id or "")).text.splitlines()
    used = sum(
        json.loads(line)["response"]["body"]["usage"]["total_tokens"] for line in done if line
    )
    codes = {json.loads(line)["response"]["body"]["error"]["code"] for line in failed if line}
    print(f"\nbatch of {lines} lines, budget {budget}: {len(done)} done ({used} tokens)")
    assert len(done) > 1  # more than the key's rate of 1 a minute: rates do not hold lines
    assert len(done) + len(failed) == lines
    assert codes == {"insufficient_quota"}
    assert budget <= used < budget + 22 * 4  # passed by at most the lines in flight (4)
    status, _, raw = await post(stack, secret, chat(2))
    assert status == 429
    assert json.loads(raw)["error"]["code"] == "insufficient_quota"
