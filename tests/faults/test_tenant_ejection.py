"""One tenant cannot take a model's providers away from everyone (outlier ejection
counts only the provider's faults, docs/ARCHITECTURE.md#outlier-ejection).

The stack runs as a real fleet does: the edge's ``mock_drills`` at its default (off),
outlier ejection at its defaults (5 failures in a row, 30 s, ``outlier_max_ejection_percent``
10). Three keys: two tenants and an operator.

- ``shared``: two mock providers. A tenant asks them to fail (``iop_mock``) and sends
  parameters the engine refuses; the operator, whose drills are honoured, asks the same.
  Neither ejects a provider: the other tenant is served throughout.
- ``broken``: three ``openai_api`` providers in front of one backend that answers 500 to
  every run (a real failure, a shared dependency down). At most the capped share of them
  is ejected: requests keep reaching a provider (502) instead of finding none (503).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from iop_proto.testing import loopback_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

SHARED = ("node-a-shared", "node-b-shared")
BROKEN = ("node-a-broken-1", "node-a-broken-2", "node-a-broken-3")
DRILL = {"iop_mock": {"fail": "provider_error", "status": 500}}
BAD_PARAMETER = {"tools": "not-a-list"}  # the engine's 400, never the edge's
LIMITS = {"max_queue": 8, "queue_timeout_ms": 10_000, "request_timeout_ms": 20_000}


def fleet(backend_port: int) -> dict[str, object]:
    def mock(provider_id: str, served: str) -> dict[str, object]:
        return {
            "id": provider_id,
            "type": "mock",
            "category": "local_inference",
            "models": [served],
            "capacity": 2,
            "tokens_per_second": 500,
            **LIMITS,
        }

    def broken(provider_id: str) -> dict[str, object]:
        return {
            "id": provider_id,
            "type": "openai_api",
            "category": "api",
            "endpoint": f"http://127.0.0.1:{backend_port}",
            "models": ["upstream"],
            "capacity": 2,
            **LIMITS,
        }

    return {
        "models": [
            {"id": "shared", "providers": {SHARED[0]: "shared-a", SHARED[1]: "shared-b"}},
            {"id": "broken", "providers": dict.fromkeys(BROKEN, "upstream")},
        ],
        "nodes": [
            {
                "id": "node-a",
                "providers": [mock(SHARED[0], "shared-a"), *(broken(p) for p in BROKEN)],
            },
            {"id": "node-b", "providers": [mock(SHARED[1], "shared-b")]},
        ],
    }


@dataclass
class Backend:
    """The ``broken`` providers' upstream: its model list answers (so every node probe
    passes), every run gets a 500."""

    runs: int = 0
    port: int = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "upstream"}]})

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.runs += 1
        return web.json_response({"error": {"message": "down", "type": "server_error"}}, status=500)


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
    root = Path(tmp_path_factory.mktemp("tenant-ejection"))
    # drills=False: the edge's settings as a real fleet has them (mock_drills off)
    async with start_stack_factory(root, fleet(backend.port), drills=False) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keys(stack: Any, faults: Any) -> dict[str, str]:
    """Tenants "a" and "b" and an operator key, once the edge knows them."""
    issued = {}
    for name, options in (("a", ()), ("b", ()), ("op", ("--operator",))):
        out = await stack.control_plane_cli("key", "issue", "--name", f"k-{name}", *options)
        found = re.search(r"sk-iop-\S+", out)
        assert found is not None, out
        issued[name] = found.group(0)

    async def known() -> bool:
        return all([await status(stack, key, "shared") == 200 for key in issued.values()])

    await faults.eventually(known, 20)
    return issued


async def status(stack: Any, key: str, model: str, extra: dict[str, Any] | None = None) -> int:
    """One chat request; the HTTP status the edge answered (the error's param kept)."""
    return (await ask(stack, key, model, extra))[0]


async def ask(
    stack: Any, key: str, model: str, extra: dict[str, Any] | None = None
) -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{stack.api_url}/chat/completions", json={**body, **(extra or {})}, headers=headers
        ) as response,
    ):
        payload = await response.json()
    error = payload.get("error") or {}
    return response.status, str(error.get("param") or error.get("code") or "")


async def providers(stack: Any, key: str) -> dict[str, dict[str, Any]]:
    url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as response:
        return {row["provider_id"]: row for row in (await response.json())["data"]}


async def test_a_tenant_s_drills_and_bad_parameters_eject_no_provider(
    stack: Any, keys: dict[str, str], report: Callable[[str], None]
) -> None:
    tenant: Counter[tuple[int, str]] = Counter()
    for _ in range(6):  # more than outlier_consecutive_failures (5), on both providers
        tenant[await ask(stack, keys["a"], "shared", DRILL)] += 1
        tenant[await ask(stack, keys["a"], "shared", BAD_PARAMETER)] += 1
    operator = Counter([await status(stack, keys["op"], "shared", DRILL) for _ in range(6)])

    rows = await providers(stack, keys["op"])
    states = {p: (rows[p]["outlier_state"], rows[p]["consecutive_failures"]) for p in SHARED}
    others: Counter[int] = Counter()
    started = time.monotonic()
    for _ in range(10):
        others[await status(stack, keys["b"], "shared")] += 1
    assert states == dict.fromkeys(SHARED, ("closed", 0)), states  # base: both ejected
    assert others == {200: 10}
    # the tenant's drills refused at the edge (400 naming iop_mock); its bad parameters
    # answered by the engine (400), the request's own fault
    assert tenant == {(400, "iop_mock"): 6, (400, ""): 6}, tenant
    assert operator == {502: 6}  # an operator's drill is honoured, and counts for nothing
    report(
        f"tenant a: {sum(tenant.values())} requests {dict(tenant)}; operator drills"
        f" {dict(operator)}; providers after: {states}; tenant b: {dict(others)} in"
        f" {time.monotonic() - started:.1f}s"
    )


async def test_all_providers_failing_for_real_keep_the_capped_share_in_selection(
    stack: Any, keys: dict[str, str], backend: Backend, report: Callable[[str], None]
) -> None:
    answers = [await status(stack, keys["b"], "broken") for _ in range(8)]
    rows = await providers(stack, keys["op"])
    ejected = sorted(p for p in BROKEN if rows[p]["outlier_state"] == "ejected")
    # 3 providers at 10 %: the first ejection only (Envoy's always-one), 2 stay in
    assert len(ejected) == 1, {p: rows[p]["outlier_state"] for p in BROKEN}  # base: 3
    assert answers[5:] == [502, 502, 502], answers  # base: 503, no provider left
    assert Counter(answers) == {502: 8}
    report(
        f"8 requests to 3 providers behind a dead backend: answers {dict(Counter(answers))},"
        f" {backend.runs} runs reached it; ejected {ejected}, the other 2 stay in selection"
    )
