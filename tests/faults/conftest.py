"""Helpers for fault tests: raw streaming clients that classify every outcome."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest


@dataclass
class Outcome:
    kind: str  # completed | error | hung
    status: int
    detail: str = ""


async def stream_chat(
    http: aiohttp.ClientSession,
    api_url: str,
    body: dict[str, Any],
    timeout_s: float,
    on_start: Callable[[], None] | None = None,
) -> Outcome:
    """One streaming request; an answer must end complete or with an OpenAI error.
    ``on_start``: called once the stream's status line is in (the edge sends it with the
    first delta: the run is streaming)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{api_url}/chat/completions", json={**body, "stream": True}) as r:
                if r.status != 200:
                    payload = await r.json()
                    assert "error" in payload, payload  # an OpenAI-style error object
                    return Outcome("error", r.status, payload["error"].get("code") or "")
                if on_start is not None:
                    on_start()
                finished = False
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        return Outcome("completed" if finished else "error", 200, "done early")
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return Outcome("error", 200, chunk["error"].get("code") or "")
                    if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                        finished = True
                return Outcome("error", 200, "stream ended without [DONE]")
    except TimeoutError:
        return Outcome("hung", 0)


async def catalog(api_url: str, kind: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(api_url.replace("/v1", f"/iop/v1/catalog/{kind}")) as response:
            return list((await response.json())["data"])


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 15) -> None:
    """Poll another process's observable state until ``check`` holds."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in another process
            await asyncio.sleep(0.1)


def pool_fleet(model: str, tag: str, **mock_settings: object) -> dict[str, object]:
    """``model`` served by one mock provider on node-a (``node-a-<tag>``, served as
    ``<model>-a``) and one on node-b: the two-node pool the fault tests stress."""

    def provider(node: str) -> dict[str, object]:
        return {
            "id": f"{node}-{tag}",
            "type": "mock",
            "category": "local_inference",
            "models": [f"{model}-{node[-1]}"],
            **mock_settings,
        }

    nodes = ("node-a", "node-b")
    return {
        "models": [{"id": model, "providers": {f"{n}-{tag}": f"{model}-{n[-1]}" for n in nodes}}],
        "nodes": [{"id": n, "providers": [provider(n)]} for n in nodes],
    }


@pytest.fixture(scope="session")
def faults() -> SimpleNamespace:
    """The helpers above, for test modules (a conftest cannot be imported)."""
    return SimpleNamespace(
        stream_chat=stream_chat,
        catalog=catalog,
        eventually=eventually,
        Outcome=Outcome,
        pool_fleet=pool_fleet,
    )


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Print a test's counts into the pytest output (run with -s to see them live)."""

    def emit(text: str) -> None:
        print(f"\n[{request.node.name}] {text}")

    return emit
