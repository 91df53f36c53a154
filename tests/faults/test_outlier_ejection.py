"""A provider that passes its probes but fails every run is ejected from its pool, tried
once after a cooldown, and back in the pool once it answers again (outlier ejection).

node-a's provider is ``openai_api`` pointed at a small HTTP server this test runs on
loopback: ``GET /v1/models`` always answers (so node-a's probes keep it ``available``),
``POST /v1/chat/completions`` answers 500 while the server is "broken". node-b's is a
mock. The flaky one is listed first, so an idle pool sends each request to it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from iop_proto.testing import loopback_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLAKY = "node-a-flaky"
MOCK = "node-b-mock"
FAILURES = 3  # outlier_consecutive_failures
COOLDOWN_S = 2.0  # outlier_cooldown_s; the second ejection in a row lasts twice as long
MAX_COOLDOWN_S = 4.0
EDGE_SETTINGS = {
    "outlier_consecutive_failures": FAILURES,
    "outlier_cooldown_s": COOLDOWN_S,
    "outlier_max_cooldown_s": MAX_COOLDOWN_S,
}


@dataclass
class Backend:
    """The flaky provider's upstream: counts what reaches it, fails while ``broken``."""

    broken: bool = True
    hits: Counter[str] = field(default_factory=Counter)  # "failed" | "ok"
    port: int = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "flaky", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        if self.broken:
            self.hits["failed"] += 1
            error = {"message": "the backend is broken", "type": "server_error"}
            return web.json_response({"error": error}, status=500)
        self.hits["ok"] += 1
        return web.json_response(
            {
                "id": "chatcmpl-flaky",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "flaky",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "fixed"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


def fleet(backend_port: int) -> dict[str, object]:
    limits = {"max_queue": 8, "queue_timeout_ms": 10_000, "request_timeout_ms": 20_000}
    flaky = {
        "id": FLAKY,
        "type": "openai_api",
        "category": "api",
        "endpoint": f"http://127.0.0.1:{backend_port}",
        "models": ["flaky"],
        "capacity": 2,
        **limits,
    }
    mock = {
        "id": MOCK,
        "type": "mock",
        "category": "local_inference",
        "models": ["pool-b"],
        "capacity": 2,
        "tokens_per_second": 200,
        **limits,
    }
    return {
        "models": [{"id": "pool", "providers": {FLAKY: "flaky", MOCK: "pool-b"}}],
        "nodes": [{"id": "node-a", "providers": [flaky]}, {"id": "node-b", "providers": [mock]}],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> AsyncIterator[Backend]:
    state = Backend()
    app = web.Application()
    app.router.add_get("/v1/models", state.models)
    app.router.add_post("/v1/chat/completions", state.chat)
    async with loopback_app(app) as port:
        state.port = port
        yield state


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, backend: Backend
) -> AsyncIterator[Any]:
    root = Path(tmp_path_factory.mktemp("outliers"))
    async with start_stack_factory(root, fleet(backend.port), EDGE_SETTINGS) as running:
        yield running


async def row(stack: Any, faults: Any, provider: str) -> dict[str, Any]:
    rows = await faults.catalog(stack.api_url, "providers")
    return next(r for r in rows if r["provider_id"] == provider)


async def edge_metric(stack: Any, name: str, provider: str) -> float | None:
    async with aiohttp.ClientSession() as http, http.get(f"{stack.edge_admin}/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("provider") == provider:
                return float(sample.value)
    return None


async def ask(sdk: AsyncOpenAI) -> str:
    """One request; ``completed`` or the HTTP status the edge answered."""
    try:
        await sdk.chat.completions.create(
            model="pool", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    except openai.APIStatusError as exc:
        return f"http {exc.status_code}"
    return "completed"


async def served_by(stack: Any, count: int) -> Counter[str]:
    """Which providers ran the last ``count`` runs, by outcome (the edge's run log)."""
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/runs")
        async with http.get(url, params={"limit": str(count)}) as response:
            runs = (await response.json())["data"]
    return Counter(f"{r['provider_id']} {r['outcome']}" for r in runs)


async def wait_outlier_state(stack: Any, faults: Any, state: str, timeout_s: float) -> float:
    """Until the catalog shows the flaky provider in ``state``; returns the time it did."""

    async def reached() -> bool:
        return (await row(stack, faults, FLAKY))["outlier_state"] == state

    await faults.eventually(reached, timeout_s)
    return time.time()


async def test_a_failing_provider_is_ejected_tried_once_and_back_when_fixed(
    stack: Any, backend: Backend, faults: Any, report: Callable[[str], None]
) -> None:
    async def both_available() -> bool:
        rows = await faults.catalog(stack.api_url, "providers")
        return all(r["health"] == "available" for r in rows) and len(rows) == 2

    await faults.eventually(both_available)
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as sdk:
        # 1. FAILURES requests in a row reach the broken backend (idle ties go to the first)
        answers: Counter[str] = Counter()
        for _ in range(FAILURES - 1):
            answers[await ask(sdk)] += 1
        before_last = time.time()
        answers[await ask(sdk)] += 1
        after_last = time.time()
        assert backend.hits == {"failed": FAILURES}
        flaky = await row(stack, faults, FLAKY)
        assert flaky.get("ejected") is True, flaky  # base: no such field, nothing ejected
        assert flaky["outlier_state"] == "ejected"
        assert flaky["health"] == "available"  # the node's word: its probes pass
        assert flaky["consecutive_failures"] == FAILURES
        until_ms = flaky["ejected_until_ms"]
        assert (before_last + COOLDOWN_S) * 1000 - 1 <= until_ms
        assert until_ms <= (after_last + COOLDOWN_S) * 1000 + 1
        assert await edge_metric(stack, "iop_edge_provider_ejected", FLAKY) == 1
        assert await edge_metric(stack, "iop_edge_ejections_total", FLAKY) == 1
        models = await faults.catalog(stack.api_url, "models")
        assert models[0]["available_providers"] == [MOCK]

        # 2. while ejected, requests avoid it: all served by the mock
        during = await asyncio.gather(*(ask(sdk) for _ in range(6)))
        assert time.time() * 1000 < until_ms  # they all ran inside the cooldown
        assert Counter(during) == {"completed": 6}
        assert backend.hits == {"failed": FAILURES}
        assert await served_by(stack, 6) == {f"{MOCK} completed": 6}

        # 3. the cooldown over, exactly one trial goes to it (still broken: ejected again)
        half_open_at = await wait_outlier_state(stack, faults, "half_open", COOLDOWN_S + 5)
        assert half_open_at * 1000 >= until_ms - 20  # the timer, not an early wake
        trial_round = await asyncio.gather(*(ask(sdk) for _ in range(3)))
        assert backend.hits == {"failed": FAILURES + 1}  # one of three, not more
        flaky = await row(stack, faults, FLAKY)
        assert flaky["outlier_state"] == "ejected"
        assert flaky["consecutive_failures"] == FAILURES + 1
        second_cooldown_ms = flaky["ejected_until_ms"] - half_open_at * 1000
        assert second_cooldown_ms >= 2 * COOLDOWN_S * 1000 - 1  # longer the second time
        assert await edge_metric(stack, "iop_edge_ejections_total", FLAKY) == 2
        assert Counter(trial_round)["completed"] >= 2  # the mock served the others

        # 4. the backend fixed: the next trial passes and the provider is back
        backend.broken = False
        await wait_outlier_state(stack, faults, "half_open", MAX_COOLDOWN_S + 5)
        assert await ask(sdk) == "completed"
        assert backend.hits["ok"] == 1
        flaky = await row(stack, faults, FLAKY)
        assert (flaky["outlier_state"], flaky["ejected"], flaky["consecutive_failures"]) == (
            "closed",
            False,
            0,
        )
        assert flaky["ejected_until_ms"] is None
        assert await edge_metric(stack, "iop_edge_provider_ejected", FLAKY) == 0
        back = [await ask(sdk) for _ in range(3)]
        assert back == ["completed"] * 3
        assert backend.hits["ok"] == 4  # idle again, the first listed takes each request
    report(
        f"{FAILURES} failures in a row (client answers {dict(answers)}) ejected {FLAKY} for"
        f" {COOLDOWN_S:g}s; during the cooldown 6 of 6 requests served by {MOCK}, none reached"
        f" the backend; the trial: 1 of 3 concurrent requests went to {FLAKY} (failed, ejected"
        f" again for {second_cooldown_ms / 1000:.2f}s); fixed, its next trial completed and the"
        " next 3 requests went to it again"
    )
