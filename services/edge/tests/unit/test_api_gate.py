"""The API's one middleware (``api_gate``): each rule in its place, over real TCP.

The rules themselves (the loopback rule, the slow-body cut, the drain's 503) are tested
against whole edges in tests/security and tests/faults; here: that a request crosses
them as one layer, in the documented order, and that the error boundary answers each
failure in its API's shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_gate import api_gate
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.http_api import create_api_app
from iop_edge.entrypoints.stop_gate import StopGate
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.testing import loopback_app


class OpenKeys:
    """No keys configured: the API is open (to loopback clients by default)."""

    configured = True  # a fleet config has arrived
    open = True

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return None


def api_app(**options: Any) -> web.Application:
    """``create_api_app`` over ports its construction only stores (nothing is served)."""
    unused = cast(Any, None)
    metrics = ApiMetrics.create(CollectorRegistry())
    return create_api_app(unused, unused, OpenKeys(), unused, metrics, openapi={}, **options)


def test_every_api_request_crosses_one_middleware() -> None:
    assert len(api_app(stop_gate=StopGate()).middlewares) == 1
    with_cors = api_app(stop_gate=StopGate(), cors_origins=["https://app.example"])
    assert len(with_cors.middlewares) == 2  # a preflight is answered before the gate


@contextlib.asynccontextmanager
async def gated(gate: StopGate, handled: list[str]) -> AsyncIterator[str]:
    """An app behind ``api_gate`` whose handlers note that they ran."""

    async def ok(request: web.Request) -> web.Response:
        handled.append(request.path)
        return web.json_response({"ok": True})

    async def broken(request: web.Request) -> web.Response:
        handled.append(request.path)
        raise RuntimeError("a bug")

    app = web.Application(middlewares=[api_gate(OpenKeys(), stop_gate=gate)])
    app.router.add_post("/v1/chat/completions", ok)
    app.router.add_post("/v1/messages", ok)

    async def store_down(request: web.Request) -> web.Response:
        handled.append(request.path)
        raise StoreDown("listing files: the PostgreSQL store is unreachable (password=x)")

    app.router.add_get("/broken", broken)
    app.router.add_get("/v1/files", store_down)
    async with loopback_app(app) as port:
        yield f"http://127.0.0.1:{port}"


async def test_a_loopback_client_of_an_open_edge_is_served() -> None:
    handled: list[str] = []
    async with gated(StopGate(), handled) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json={"model": "m"}) as reply:
            assert reply.status == 200
            assert await reply.json() == {"ok": True}
    assert handled == ["/v1/chat/completions"]


async def test_a_closed_gate_answers_before_anything_else_runs() -> None:
    gate, handled = StopGate(), list[str]()
    gate.close()
    async with gated(gate, handled) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json={"model": "m"}) as reply:
            assert reply.status == 503
            assert reply.headers["Connection"] == "close"
            assert (await reply.json())["error"]["code"] == "shutting_down"
        async with http.post(f"{url}/v1/messages", json={"model": "m"}) as reply:
            assert reply.status == 529  # Anthropic's shape on its paths
            assert (await reply.json())["type"] == "error"
        async with http.get(f"{url}/no/such/route") as reply:
            assert reply.status == 503  # not a 404: the gate comes first
    assert handled == []


async def test_the_boundary_answers_every_error_in_its_api_s_shape() -> None:
    handled: list[str] = []
    async with gated(StopGate(), handled) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/no/such/route") as reply:
            assert reply.status == 404
            assert (await reply.json())["error"]["code"] == "unknown_url"
        async with http.get(f"{url}/v1/messages") as reply:  # a route for POST only
            assert reply.status == 405
            error = await reply.json()
            assert error["type"] == "error"
            assert error["error"]["type"] == "invalid_request_error"
        async with http.get(f"{url}/broken") as reply:
            assert reply.status == 500
            assert (await reply.json())["error"]["type"] == "server_error"
    assert handled == ["/broken"]


async def test_the_shared_store_down_is_a_retryable_503_that_hides_its_cause() -> None:
    handled: list[str] = []
    async with gated(StopGate(), handled) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/files") as reply:
            assert reply.status == 503
            assert reply.headers["Retry-After"] == "2"
            error = (await reply.json())["error"]
    assert error["code"] == "storage_unavailable"
    assert "password" not in error["message"]
    assert handled == ["/v1/files"]
