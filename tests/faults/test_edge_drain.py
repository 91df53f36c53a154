"""The edge stopped with SIGTERM mid-stream: it stops accepting, lets its runs finish, and
fails only what outlasts ``shutdown_timeout_s`` (minus ``shutdown_reserve_s``)."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

pytestmark = pytest.mark.asyncio(loop_scope="module")

MOCK = {
    "capacity": 2,
    "max_queue": 8,
    "queue_timeout_ms": 15_000,
    "request_timeout_ms": 30_000,
    "tokens_per_second": 20,  # 40 tokens: two seconds per stream
}
SHUTDOWN_TIMEOUT_S = 6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, faults: Any
) -> AsyncIterator[Any]:
    fleet = faults.pool_fleet("pool", "mock", **MOCK)
    root = Path(tmp_path_factory.mktemp("edge-drain"))
    async with start_stack_factory(root, fleet) as running:
        running.edge_defaults = (root / "edge.yaml").read_text()
        yield running


def api_address(stack: Any) -> tuple[str, int]:
    host, port = stack.api_url.removeprefix("http://").split("/", 1)[0].split(":")
    return host, int(port)


async def refused(stack: Any) -> bool:
    """A new connection to the API is refused (the listener is closed)."""
    try:
        _, writer = await asyncio.open_connection(*api_address(stack))
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def restart_edge(stack: Any, faults: Any, **settings: object) -> None:
    """Start the stopped edge again: the stack's settings with ``settings`` over them."""
    data = yaml.safe_load(stack.edge_defaults)
    (stack.root / "edge.yaml").write_text(yaml.safe_dump({**data, **settings}))
    edge = await stack.start("edge")
    stack.edge_admin = edge.admin_url

    async def both_connected() -> bool:
        rows = await faults.catalog(stack.api_url, "providers")
        return len(rows) == 2 and all(r["health"] == "available" for r in rows)

    await faults.eventually(both_connected, timeout_s=20)


async def test_sigterm_lets_the_streams_in_flight_finish(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    await stack.stop("edge")  # the shared fixture's defaults: come back with a known timeout
    await restart_edge(stack, faults, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)
    body = {
        "model": "pool",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 40,
        "iop_mock": {"fill": True},  # 40 tokens, not the mock's short answer
    }
    loop = asyncio.get_running_loop()
    async with (
        aiohttp.ClientSession() as http,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept,
    ):
        async with kept.get(stack.api_url + "/models") as response:  # a kept-alive connection
            assert response.status == 200
            await response.read()
        streams = [
            asyncio.create_task(faults.stream_chat(http, stack.api_url, body, 20)) for _ in range(4)
        ]

        async def all_busy() -> bool:
            rows = await faults.catalog(stack.api_url, "providers")
            return sum(r["in_flight"] for r in rows) == 4

        await faults.eventually(all_busy)
        started = loop.time()
        stack.services["edge"].process.send_signal(signal.SIGTERM)
        await faults.eventually(lambda: refused(stack), timeout_s=5)
        refused_after_s = loop.time() - started
        # A request on the connection opened before: a 503, and the connection closes.
        async with kept.get(stack.api_url + "/models") as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "shutting_down"
            assert response.headers.get("Connection", "").lower() == "close"
        outcomes = await asyncio.gather(*streams)
        exit_code = await asyncio.wait_for(stack.stop("edge"), SHUTDOWN_TIMEOUT_S + 2)
        stop_s = loop.time() - started
    counts = Counter(o.kind for o in outcomes)
    report(
        f"outcomes {dict(counts)}, new connections refused {refused_after_s:.2f}s after "
        f"SIGTERM, edge exit code {exit_code} after {stop_s:.2f}s"
    )
    assert counts == {"completed": 4}
    assert exit_code == 0
    assert stop_s < SHUTDOWN_TIMEOUT_S


async def test_a_run_that_outlasts_the_timeout_gets_an_error_event(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    await restart_edge(stack, faults, shutdown_timeout_s=3, shutdown_reserve_s=1)
    long = {
        "model": "pool",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 400,
        "iop_mock": {"fill": True},  # 400 tokens, not the mock's short answer
    }
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        stream = asyncio.create_task(faults.stream_chat(http, stack.api_url, long, 30))

        async def busy() -> bool:
            rows = await faults.catalog(stack.api_url, "providers")
            return sum(r["in_flight"] for r in rows) == 1

        await faults.eventually(busy)
        started = loop.time()
        stack.services["edge"].process.send_signal(signal.SIGTERM)
        outcome = await stream
        ended_s = loop.time() - started
        exit_code = await asyncio.wait_for(stack.stop("edge"), 5)
    report(f"the 20 s stream ended {ended_s:.2f}s after SIGTERM: {outcome}; exit {exit_code}")
    assert (outcome.kind, outcome.status) == ("error", 200)  # an SSE error event, mid-stream
    assert exit_code == 0
    await restart_edge(stack, faults)  # the stack's own settings again, for whoever follows


async def test_a_draining_edge_answers_its_queued_requests_at_once_and_starts_none(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    """Queued requests get their retryable 503 when the drain begins (started later, they
    would only be cut at its end); the runs in flight finish."""
    await stack.stop("edge")
    await restart_edge(stack, faults, shutdown_timeout_s=12)
    in_flight = {
        "model": "pool",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 80,
        "iop_mock": {"fill": True},  # 80 tokens at 20/s: four seconds per stream
    }
    queued_body = {**in_flight, "stream": True}
    loop = asyncio.get_running_loop()
    answered: list[tuple[int, str, str | None, float]] = []

    async def queued_request(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{stack.api_url}/chat/completions", json=queued_body) as response:
            payload = await response.json() if response.status != 200 else {}
            code = payload.get("error", {}).get("code", "")
            retry_after = response.headers.get("Retry-After")
            answered.append((response.status, code, retry_after, loop.time()))
            await response.read()

    async with aiohttp.ClientSession() as http:
        streams = [
            asyncio.create_task(faults.stream_chat(http, stack.api_url, in_flight, 30))
            for _ in range(4)
        ]

        async def all_busy() -> bool:
            rows = await faults.catalog(stack.api_url, "providers")
            return bool(sum(r["in_flight"] for r in rows) == 4)

        await faults.eventually(all_busy)
        waiting = [asyncio.create_task(queued_request(http)) for _ in range(3)]

        async def all_queued() -> bool:
            rows = await faults.catalog(stack.api_url, "models")
            return bool(sum(r["queued"] for r in rows) == 3)

        await faults.eventually(all_queued)
        stack.services["edge"].process.send_signal(signal.SIGTERM)
        sigterm = loop.time()
        await asyncio.gather(*waiting)  # a hang fails the test by its timeout
        outcomes = await asyncio.gather(*streams)
        in_flight_done = loop.time()
        exit_code = await asyncio.wait_for(stack.stop("edge"), 15)
    report(
        f"queued requests answered {[f'{s} {c}' for s, c, _, _ in answered]} within "
        f"{max(t for *_, t in answered) - sigterm:.2f}s of SIGTERM; the runs in flight "
        f"{dict(Counter(o.kind for o in outcomes))}, {in_flight_done - sigterm:.2f}s after it"
    )
    assert [(status, code, retry) for status, code, retry, _ in answered] == [
        (503, "shutting_down", "1")
    ] * 3, "a queued request was started by the draining edge"
    assert max(t for *_, t in answered) < in_flight_done  # before the runs in flight ended
    assert Counter(o.kind for o in outcomes) == {"completed": 4}
    assert exit_code == 0
    await restart_edge(stack, faults)  # the stack's own settings again, for whoever follows
