"""The load generator's side: one target per gateway, timed requests, streams, statistics.

Every column of the report is driven by this same client, so what it costs is the
same for all of them; what differs between columns is only the gateway in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

REQUEST_TIMEOUT: Final = aiohttp.ClientTimeout(total=60, sock_connect=5)
PROMPT: Final = [{"role": "user", "content": "Say hello."}]
FAKE_CONTENT: Final = b'"x '  # the fake backend's text: every content chunk carries it


@dataclass(frozen=True)
class Target:
    """One way to reach the fake backend: directly, through IOP, through LiteLLM."""

    name: str  # direct | iop | litellm
    base_url: str  # ends in /v1
    model: str
    api_key: str = "sk-bench"

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def body(self, *, max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": PROMPT,
            "max_tokens": max_tokens,
            "stream": stream,
            **extra,
        }


@contextlib.asynccontextmanager
async def session(
    connections: int, *, keepalive: bool = True
) -> AsyncIterator[aiohttp.ClientSession]:
    """A session with room for ``connections`` (no per-host cap below it).

    Keep-alive by default, as a client of a gateway would be. ``keepalive=False``
    for servers that drop idle connections on their own schedule (llama.cpp's):
    a request sent on a connection being closed would fail, not be retried.
    """
    connector = aiohttp.TCPConnector(
        limit=connections, limit_per_host=connections, force_close=not keepalive
    )
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as http:
        yield http


class RequestFailed(Exception):
    """A benchmark request did not get a 200 and a complete answer."""


OVERHEAD_HEADER: Final = "x-iop-overhead-ms"


async def complete(
    http: aiohttp.ClientSession,
    target: Target,
    max_tokens: int = 8,
    reported: list[float] | None = None,
) -> float:
    """One non-streamed chat completion; returns its latency in seconds. With
    ``reported``, the gateway's own ``x-iop-overhead-ms`` (in ms) is appended to it."""
    headers = {"Authorization": f"Bearer {target.api_key}"}
    started = time.perf_counter()
    async with http.post(
        target.chat_url, json=target.body(max_tokens=max_tokens), headers=headers
    ) as response:
        body = await response.read()
        elapsed = time.perf_counter() - started
    if response.status != 200 or b'"choices"' not in body:
        raise RequestFailed(f"{target.name}: HTTP {response.status}: {body[:300]!r}")
    if reported is not None:
        value = response.headers.get(OVERHEAD_HEADER)
        if value is None:
            raise RequestFailed(f"{target.name}: no {OVERHEAD_HEADER} header")
        reported.append(float(value))
    return elapsed


@dataclass
class StreamTiming:
    """When each content chunk of one stream arrived (seconds from the request's start)."""

    arrivals: list[float] = field(default_factory=list)
    total_s: float = 0.0
    data_lines: int = 0
    content_chunks: int = 0
    usage_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] if self.arrivals else float("nan")

    @property
    def max_gap_s(self) -> float:
        gaps = [b - a for a, b in itertools.pairwise(self.arrivals)]
        return max(gaps, default=0.0)


async def stream(
    http: aiohttp.ClientSession,
    target: Target,
    max_tokens: int,
    *,
    timed: bool = True,
    marker: bytes = FAKE_CONTENT,
    expect: int | None = None,
    **extra: Any,
) -> StreamTiming:
    """One streamed chat completion, read line by line as it arrives.

    A content chunk is a ``data:`` line containing ``marker``: every gateway relays
    the fake's ``"x "`` unchanged, so a byte search finds it without parsing JSON
    (parsing 20,000 chunks/s would make the client the bottleneck). Fewer than
    ``expect`` content chunks (default ``max_tokens``) is a failure.
    ``timed=False`` skips the per-chunk clock for the throughput runs.
    """
    headers = {"Authorization": f"Bearer {target.api_key}"}
    body = target.body(max_tokens=max_tokens, stream=True, **extra)
    timing = StreamTiming()
    clock = time.perf_counter
    started = clock()
    async with http.post(target.chat_url, json=body, headers=headers) as response:
        if response.status != 200:
            text = await response.read()
            raise RequestFailed(f"{target.name}: HTTP {response.status}: {text[:300]!r}")
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            timing.data_lines += 1
            if marker in line:
                timing.content_chunks += 1
                if timed:
                    timing.arrivals.append(clock() - started)
            if b'"completion_tokens"' in line:
                timing.usage_tokens = _completion_tokens(line)
        timing.total_s = clock() - started
    wanted = max_tokens if expect is None else expect
    if timing.content_chunks < wanted:
        raise RequestFailed(
            f"{target.name}: {timing.content_chunks} content chunks, expected {wanted}"
        )
    return timing


def _completion_tokens(line: bytes) -> int:
    try:
        usage = json.loads(line[len(b"data:") :]).get("usage") or {}
    except ValueError:
        return 0
    value = usage.get("completion_tokens")
    return value if isinstance(value, int) else 0


def rotated(names: Sequence[str], i: int) -> list[str]:
    """``names`` starting at the ``i``-th (modulo): round ``i``'s order, so that no target
    always goes first on a warm cache (every scenario alternates its targets this way)."""
    k = i % len(names)
    return [*names[k:], *names[:k]]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 10) - 1]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """p50, p99, mean, min, max in milliseconds, and the count."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "mean": statistics.fmean(ms) if ms else float("nan"),
        "min": min(ms, default=float("nan")),
        "max": max(ms, default=float("nan")),
    }


async def closed_loop(
    http: aiohttp.ClientSession,
    target: Target,
    concurrency: int,
    duration_s: float,
    latencies: list[float] | None = None,
) -> tuple[int, int, float]:
    """``concurrency`` workers each sending back to back for ``duration_s``.

    Returns (completed, failed, elapsed seconds). Requests started before the end
    are allowed to finish (and counted), so elapsed is a little over the duration.
    Each completed request's latency is appended to ``latencies`` when given.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    end = started + duration_s
    done = failed = 0

    async def worker() -> None:
        nonlocal done, failed
        while loop.time() < end:
            try:
                latency = await complete(http, target)
            except (RequestFailed, aiohttp.ClientError, TimeoutError):
                failed += 1
            else:
                done += 1
                if latencies is not None:
                    latencies.append(latency)

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    return done, failed, loop.time() - started
