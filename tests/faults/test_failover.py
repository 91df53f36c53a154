"""Failover before the first byte (docs/ARCHITECTURE.md#failover), on a real stack.

Two pools on one stack (node-a and node-b, real mTLS, real nodes):
- ``refusing``: an OpenAI-compatible provider on node-a whose server answers its probe
  (``GET /v1/models``) but drops every run's connection without an answer, as a proxy
  in front of a dead engine does, and a mock on node-b. Each run it gets fails
  ``provider_unavailable``; the node takes it out of selection, its next probe puts it
  back, and so on. The pool must still answer every request.
- ``pool``: a mock on each node; node-a is SIGKILLed while it holds non-streamed
  requests and streams that have not produced their first token (the mock's
  ``delay_ms`` drill holds them there) and streams past their first token.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

REFUSING = "node-a-refusing"
REFUSING_MOCK = "node-b-steady"
REQUEST_TIMEOUT_S = 20
MOCK = {
    "capacity": 8,
    "max_queue": 16,
    "queue_timeout_ms": 15_000,
    "request_timeout_ms": REQUEST_TIMEOUT_S * 1000,
}


class RefusingUpstream:
    """An HTTP server that answers ``GET /v1/models`` and closes the connection on
    anything else, before any response byte."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self.dropped = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"GET /v1/models "):
                    self.dropped += 1
                    return  # closed below: no status line, nothing
                body = json.dumps({"object": "list", "data": [{"id": "refused"}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def fleet(upstream_port: int) -> dict[str, Any]:
    def mock(pid: str, served: str) -> dict[str, object]:
        return {"id": pid, "type": "mock", "category": "local_inference", "models": [served]}

    refusing = {
        "id": REFUSING,
        "type": "vllm",
        "category": "local_inference",
        "endpoint": f"http://127.0.0.1:{upstream_port}",
        "models": ["refused"],
        **MOCK,
    }
    steady = {**mock(REFUSING_MOCK, "steady"), **MOCK, "tokens_per_second": 200}
    slow = {"tokens_per_second": 5, **MOCK}
    return {
        "models": [
            {"id": "refusing", "providers": {REFUSING: "refused", REFUSING_MOCK: "steady"}},
            {"id": "pool", "providers": {"node-a-mock": "pool-a", "node-b-mock": "pool-b"}},
        ],
        "nodes": [
            {"id": "node-a", "providers": [refusing, {**mock("node-a-mock", "pool-a"), **slow}]},
            {"id": "node-b", "providers": [steady, {**mock("node-b-mock", "pool-b"), **slow}]},
        ],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream() -> AsyncIterator[RefusingUpstream]:
    server = RefusingUpstream()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, upstream: Any
) -> AsyncIterator[Any]:
    root = Path(tmp_path_factory.mktemp("failover"))
    async with start_stack_factory(root, fleet(upstream.port)) as running:
        yield running


@dataclass
class Answer:
    kind: str  # completed | error (an HTTP error) | sse_error (after the status line) | hung
    status: int
    request_id: str
    code: str = ""
    first_token: bool = False


async def ask(
    http: aiohttp.ClientSession,
    api_url: str,
    body: dict[str, Any],
    first_token: asyncio.Event | None = None,
) -> Answer:
    """One request, streamed when ``body`` says so; ``first_token`` is set at its first
    content chunk."""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S + 10):
            async with http.post(f"{api_url}/chat/completions", json=body) as response:
                request_id = response.headers.get("X-Request-Id", "")
                if response.status != 200:
                    error = (await response.json())["error"]
                    return Answer("error", response.status, request_id, error.get("code") or "")
                if not body.get("stream"):
                    answer = await response.json()
                    assert answer["choices"][0]["message"]["content"], answer
                    return Answer("completed", 200, request_id)
                return await _read_stream(response, request_id, first_token)
    except TimeoutError:
        return Answer("hung", 0, "")


async def _read_stream(
    response: aiohttp.ClientResponse, request_id: str, first_token: asyncio.Event | None
) -> Answer:
    seen = False
    finished = False
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            kind = "completed" if finished else "sse_error"
            return Answer(kind, 200, request_id, "" if finished else "done early", seen)
        chunk = json.loads(data)
        if "error" in chunk:
            return Answer("sse_error", 200, request_id, chunk["error"].get("code") or "", seen)
        choices = chunk.get("choices", [])
        if any(c.get("delta", {}).get("content") for c in choices):
            seen = True
            if first_token is not None:
                first_token.set()
        finished = finished or any(c.get("finish_reason") for c in choices)
    return Answer("sse_error", 200, request_id, "stream ended without [DONE]", seen)


async def runs(stack: Any, limit: int) -> dict[str, dict[str, Any]]:
    """The edge's run log (pending records included), by run id."""
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/runs")
        async with http.get(url, params={"limit": str(limit)}) as response:
            return {r["run_id"]: r for r in (await response.json())["data"]}


async def retries_metric(stack: Any, model: str) -> dict[str, float]:
    """``iop_edge_retries_total`` of ``model`` by the provider that failed."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.edge_admin}/metrics") as response:
            text = await response.text()
    pattern = rf'^iop_edge_retries_total\{{model="{re.escape(model)}",provider="([^"]+)"\}} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


async def wait_available(stack: Any, faults: Any, providers: tuple[str, ...]) -> None:
    async def all_available() -> bool:
        rows = {r["provider_id"]: r for r in await faults.catalog(stack.api_url, "providers")}
        return all(rows[p]["health"] == "available" for p in providers)

    await faults.eventually(all_available)


async def test_a_provider_refusing_every_run_costs_its_pool_no_request(
    stack: Any, upstream: RefusingUpstream, faults: Any, report: Callable[[str], None]
) -> None:
    await wait_available(stack, faults, (REFUSING, REFUSING_MOCK))
    gate = asyncio.Semaphore(10)
    plain = {"model": "refusing", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async with aiohttp.ClientSession() as http:

        async def one(n: int) -> Answer:
            async with gate:
                return await ask(http, stack.api_url, {**plain, "stream": n % 2 == 1})

        answers = await asyncio.gather(*(one(n) for n in range(100)))

    kinds = Counter(a.kind for a in answers)
    codes = Counter(a.code for a in answers if a.kind != "completed")
    report(f"100 requests (50 streamed): outcomes {dict(kinds)} {dict(codes) or ''}")
    assert kinds == {"completed": 100}
    log = await runs(stack, 100)
    records = [log[a.request_id] for a in answers]
    failed_over = [r for r in records if len(r["attempts"]) > 1]
    retried = await retries_metric(stack, "refusing")
    report(
        f"{REFUSING} dropped {upstream.dropped} runs; {len(failed_over)} requests failed over "
        f"to {REFUSING_MOCK}; iop_edge_retries_total {retried}"
    )
    assert failed_over  # the refusing provider was chosen, at first at least
    assert retried == {REFUSING: len(failed_over)}
    for record in failed_over:
        first, last = record["attempts"][0], record["attempts"][-1]
        assert (first["provider_id"], first["outcome"], first["error_code"]) == (
            REFUSING,
            "failed",
            "provider_unavailable",
        )
        assert (last["provider_id"], last["outcome"]) == (REFUSING_MOCK, "completed")
        assert first["run_id"] != last["run_id"]
        assert record["run_id"] == first["run_id"]
        assert record["provider_id"] == REFUSING_MOCK
    assert all(r["outcome"] == "completed" for r in records)


async def test_a_node_killed_under_runs_before_their_first_byte_costs_none_of_them(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    await wait_available(stack, faults, ("node-a-mock", "node-b-mock"))
    messages = [{"role": "user", "content": "go"}]
    # 30 tokens at 5 tokens/s: 6 s of stream, well past the kill
    running = {"model": "pool", "messages": messages, "max_tokens": 30, "stream": True}
    # held 4 s before their first token (on each node they reach): in flight at the kill
    held = {"model": "pool", "messages": messages, "max_tokens": 2, "iop_mock": {"delay_ms": 4000}}

    async with aiohttp.ClientSession() as http:
        firsts = [asyncio.Event() for _ in range(4)]
        streaming = [
            asyncio.create_task(ask(http, stack.api_url, running, first)) for first in firsts
        ]
        for first in firsts:
            await asyncio.wait_for(first.wait(), 10)
        waiting = [
            asyncio.create_task(ask(http, stack.api_url, {**held, "stream": n % 2 == 0}))
            for n in range(8)
        ]

        async def all_in_flight() -> bool:
            rows = await faults.catalog(stack.api_url, "providers")
            return sum(r["in_flight"] for r in rows if r["provider_id"].endswith("-mock")) == 12

        await faults.eventually(all_in_flight)
        await stack.stop("node-a", signal.SIGKILL)
        streamed = await asyncio.gather(*streaming)
        held_answers = await asyncio.gather(*waiting)

    held_kinds = Counter(a.kind for a in held_answers)
    codes = Counter(a.code for a in held_answers if a.kind != "completed")
    report(f"node-a SIGKILLed: the 8 held requests {dict(held_kinds)} {dict(codes) or ''}")
    assert [a.kind for a in held_answers] == ["completed"] * 8, held_answers
    log = await runs(stack, 50)
    held_records = [log[a.request_id] for a in held_answers if a.request_id in log]
    failed_over = [r for r in held_records if len(r["attempts"]) > 1]
    on_a = [a for a in streamed if log[a.request_id]["attempts"][0]["provider_id"] == "node-a-mock"]
    retried = await retries_metric(stack, "pool")
    report(
        f"of the 8 held (4 non-streamed, 4 streams before their first token), "
        f"{len(failed_over)} failed over to node-b; streams past their first token "
        f"{dict(Counter(a.kind for a in streamed))} ({len(on_a)} were on node-a, ending with "
        f"SSE error codes {[a.code for a in on_a]}); iop_edge_retries_total {retried}"
    )
    assert failed_over  # node-a held some of them
    for record in failed_over:
        first, last = record["attempts"][0], record["attempts"][-1]
        assert (first["provider_id"], first["error_code"]) == (
            "node-a-mock",
            "provider_unavailable",
        )
        assert (last["provider_id"], last["outcome"]) == ("node-b-mock", "completed")
    assert on_a  # the selection alternates: node-a had streams past their first token
    for answer in streamed:
        record = log[answer.request_id]
        assert len(record["attempts"]) == 1  # never silently continued elsewhere
        if record["provider_id"] == "node-a-mock":
            assert (answer.kind, answer.code, answer.first_token) == (
                "sse_error",
                "provider_unavailable",
                True,
            )
        else:
            assert answer.kind == "completed"
    assert retried == {"node-a-mock": len(failed_over)}
