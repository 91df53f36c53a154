"""One set of limits, end to end: what the API takes, the node link carries, or it refuses.

Against the real stack (control-plane, edge, two nodes, a worker; real mTLS):

- chat bodies over the node link's frame limit (20 MiB; and a 5 MB one that grows
  past it when written again) get a 413 OpenAI error, more of them than
  ``mock-small`` has slots, and afterwards every slot is free and the model
  serves at full capacity;
- a batch with one oversize line completes, that line in the error file with
  its reason, and a later batch runs;
- a body nested 1,000 levels deep is a 400 naming the limit, and the edge's log
  does not grow by more than a few KB for it;
- ``max_tokens`` of 2**31 is a 400 naming the field.

Each of these fails on the code before the limits (500s and slots lost for good,
a batch in progress forever, 400 KB of traceback per request, a slot held).
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
MODEL = "mock-small"  # node-a-mock and node-b-mock, 2 slots each
PROVIDERS = ("node-a-mock", "node-b-mock")
CAPACITY = 4
MiB = 1024 * 1024
OVERSIZE = 20 * MiB  # under the old 64 MiB HTTP limit, over the 16 MiB frame limit
DEEP = 1000
LOG_BYTES_PER_REQUEST = 2048


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sdk(stack: Stack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=stack.api_url, api_key="x", max_retries=0, timeout=20
    ) as client:
        yield client


def report(text: str) -> None:
    print(f"\n[limits] {text}")


def chat_body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def post_raw(stack: Stack, body: bytes, path: str = "chat/completions") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{stack.api_url}/{path}",
            data=io.BytesIO(body),  # streamed, not one huge write
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as response:
            return response.status, json.loads(await response.read())


async def providers(stack: Stack) -> dict[str, dict[str, Any]]:
    url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            return {row["provider_id"]: row for row in (await response.json())["data"]}


async def in_flight(stack: Stack) -> int:
    rows = await providers(stack)
    return sum(int(rows[p]["in_flight"]) for p in PROVIDERS)


async def wait_available(stack: Stack) -> None:
    async with asyncio.timeout(15):
        while True:
            rows = await providers(stack)
            if all(rows[p]["health"] == "available" for p in PROVIDERS):
                return
            await asyncio.sleep(0.1)


def assert_openai_error(payload: Any, code: str | None = None) -> dict[str, Any]:
    assert isinstance(payload, dict), payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


async def serves_at_full_capacity(stack: Stack, sdk: AsyncOpenAI) -> int:
    """Hold CAPACITY streams open at once (each got its first token, so each has a
    slot), count the slots in use, and let them finish; every one must complete."""
    started = [asyncio.Event() for _ in range(CAPACITY)]
    release = asyncio.Event()

    async def one(index: int) -> str:
        stream = await sdk.chat.completions.create(
            **chat_body(f"stream {index}"),
            max_tokens=60,
            stream=True,
            extra_body={"iop_mock": {"fill": True}},  # 60 tokens, ending with length
        )
        finish = ""
        async for chunk in stream:
            if not started[index].is_set():
                started[index].set()
                await release.wait()
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        return finish

    tasks = [asyncio.create_task(one(i)) for i in range(CAPACITY)]
    try:
        async with asyncio.timeout(10):
            await asyncio.gather(*(event.wait() for event in started))
        busy = await in_flight(stack)
    finally:
        release.set()
    finishes = await asyncio.gather(*tasks)
    assert finishes == ["length"] * CAPACITY
    return busy


# ---------------------------------------------------------------- bodies over the frame


async def test_bodies_the_node_link_cannot_carry_get_413_and_take_no_slot(
    stack: Stack, sdk: AsyncOpenAI
) -> None:
    await wait_available(stack)
    head = b'{"model": "mock-small", "messages": [{"role": "user", "content": "'
    oversize = head + b"a" * (OVERSIZE - len(head) - 4) + b'"}]}'
    # 5 MB that read fine but take 19 MB written again (1e15 -> 1000000000000000.0).
    grows = (
        b'{"model": "mock-small", "messages": [{"role": "user", "content": "hi"}], "x": ['
        + b",".join([b"1e15"] * 1_000_000)
        + b"]}"
    )
    answers = await asyncio.gather(
        *(post_raw(stack, oversize) for _ in range(CAPACITY + 2)), post_raw(stack, grows)
    )
    after = await in_flight(stack)
    report(
        f"{CAPACITY + 2} x {len(oversize)} bytes and 1 x {len(grows)} bytes: statuses "
        f"{[status for status, _ in answers]}; slots of {MODEL} in use after them: {after}"
    )
    for status, payload in answers:
        assert status == 413, (status, payload)
        assert_openai_error(payload, "request_too_large")
    assert after == 0

    busy = await serves_at_full_capacity(stack, sdk)
    report(f"afterwards {busy} of {CAPACITY} slots served streams at once")
    assert busy == CAPACITY
    assert await in_flight(stack) == 0


# ---------------------------------------------------------------- a batch line over the frame


def chat_line(custom_id: str, content: str = "hi") -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": chat_body(content, max_tokens=2),
    }


async def run_batch(sdk: AsyncOpenAI, lines: list[dict[str, Any]], timeout_s: float) -> Any:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = await sdk.files.create(file=("batch.jsonl", content), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        async with asyncio.timeout(timeout_s):
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                await asyncio.sleep(0.2)
                batch = await sdk.batches.retrieve(batch.id)
    except TimeoutError:
        raise AssertionError(f"batch {batch.id} still {batch.status} after {timeout_s}s") from None
    return batch


async def results(sdk: AsyncOpenAI, file_id: str | None) -> dict[str, Any]:
    if not file_id:
        return {}
    content = await sdk.files.content(file_id)
    rows = [json.loads(line) for line in content.text.splitlines() if line]
    return {row["custom_id"]: row for row in rows}


async def test_a_batch_line_over_the_frame_fails_alone_and_the_batch_goes_on(
    stack: Stack, sdk: AsyncOpenAI
) -> None:
    lines = [chat_line("ok-1"), chat_line("huge", "a" * OVERSIZE), chat_line("ok-2")]
    batch = await run_batch(sdk, lines, timeout_s=30)
    output, errors = (
        await results(sdk, batch.output_file_id),
        await results(sdk, batch.error_file_id),
    )
    report(
        f"batch with a {OVERSIZE}-byte line: {batch.status}, "
        f"{batch.request_counts.completed} completed, {batch.request_counts.failed} failed"
    )
    assert batch.status == "completed"
    assert sorted(output) == ["ok-1", "ok-2"]
    assert list(errors) == ["huge"]
    response = errors["huge"]["response"]
    assert response["status_code"] == 413
    error = assert_openai_error(response["body"], "request_too_large")
    assert "limit" in error["message"]

    later = await run_batch(sdk, [chat_line("later")], timeout_s=30)
    assert later.status == "completed"
    assert list(await results(sdk, later.output_file_id)) == ["later"]


# ---------------------------------------------------------------- deep JSON


async def log_marker(stack: Stack) -> int:
    """The edge's log size once everything it wrote so far has been read: a TLS refusal
    it logs (naming this connection's port) comes after anything written before it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.node_port)
    port = writer.get_extra_info("sockname")[1]
    writer.write(b"not a TLS client hello\r\n\r\n")
    await writer.drain()
    await reader.read()
    writer.close()
    await writer.wait_closed()
    edge = stack.services["edge"]
    await asyncio.wait_for(edge.wait_for_line(f", {port}) at tls"), 10)
    return sum(len(line) for line in edge.log)


@pytest.mark.parametrize("where", ["content", "vendor field"])
async def test_a_body_nested_1000_deep_is_a_400_naming_the_limit_and_a_short_log(
    stack: Stack, where: str
) -> None:
    nested = "[" * DEEP + "]" * DEEP
    if where == "content":
        raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {nested}}}]}}'
    else:
        raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
        raw += f'"vendor": {{"x": {nested}}}}}'
    before = await log_marker(stack)
    requests = 5
    answers = [await post_raw(stack, raw.encode()) for _ in range(requests)]
    grew = await log_marker(stack) - before
    marker = 200  # the marker's own line, roughly
    report(
        f"{requests} x {len(raw)}-byte bodies nested {DEEP} deep ({where}): "
        f"{[status for status, _ in answers]}; the edge's log grew {grew} bytes"
    )
    for status, payload in answers:
        assert status == 400, (status, payload)
        error = assert_openai_error(payload)
        assert error["type"] == "invalid_request_error"
        assert "nested deeper than 64 levels" in error["message"]
    assert grew < requests * LOG_BYTES_PER_REQUEST + marker


# ---------------------------------------------------------------- the output cap


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 2**31), ("max_completion_tokens", 2**31), ("max_tokens", 0)],
)
async def test_an_output_length_past_the_cap_is_a_400_naming_the_field(
    stack: Stack, sdk: AsyncOpenAI, field: str, value: int
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(**chat_body(), **{field: value})
    error = refused.value
    report(f"{field}={value}: {error.status_code} {error.code} param={error.param}")
    assert (error.status_code, error.param) == (400, field)
    assert isinstance(error.body, dict)
    assert error.body["type"] == "invalid_request_error"
    assert await in_flight(stack) == 0


async def test_completions_max_tokens_past_the_cap_is_a_400(sdk: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.completions.create(model=MODEL, prompt="once", max_tokens=2**31)
    assert (refused.value.status_code, refused.value.param) == (400, "max_tokens")
    assert "Expected a value <= 2147483647" in refused.value.message  # not clamped: refused
