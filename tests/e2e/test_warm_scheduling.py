"""Warm-aware scheduling on a real stack (docs/ARCHITECTURE.md#warm-aware-scheduling):
edge, control-plane and two nodes as processes over mTLS, each node's provider an
Ollama-shaped double in a process of its own (``tools/ollama_double.py``: Ollama's API,
a load that takes its time before the first token, warm answers at once, ``/api/ps``).

What a provider did is read where it happened: the double's own count of the loads it
made (``/double/stats``); what the edge knows, in its catalog.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from iop_node.adapters.ollama import OllamaAdapter
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import ExecutionSpec, Operation
from iop_node.ports import AdapterContext
from iop_node.testing import RecordingSink
from iop_proto import json_codec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from ollama_double import spawned

pytestmark = pytest.mark.asyncio

LOAD_S = "1.5"


def ollama(provider_id: str, endpoint: str, served: list[str], **extra: object) -> dict[str, Any]:
    return {
        "id": provider_id,
        "type": "ollama",
        "category": "local_inference",
        "endpoint": endpoint,
        "models": served,
        "capacity": 4,
        "max_queue": 16,
        "queue_timeout_ms": 60_000,
        "request_timeout_ms": 60_000,
        **extra,
    }


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await asyncio.sleep(0.1)


async def get(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def loads(double: str) -> dict[str, int]:
    """The loads the double made, by model: its own count."""
    return dict((await get(f"{double}/double/stats"))["loads"])


async def provider_row(stack: Any, provider_id: str) -> dict[str, Any]:
    rows = (await get(stack.api_url.replace("/v1", "/iop/v1/catalog/providers")))["data"]
    return next(row for row in rows if row["provider_id"] == provider_id)


async def warm_row(stack: Any, provider_id: str, served: str) -> dict[str, Any]:
    row = await provider_row(stack, provider_id)
    return next(m for m in row["warmth"]["models"] if m["name"] == served)


async def chat(stack: Any, model: str, **extra: object) -> float:
    """One streamed chat request through the edge; its time to first token, in seconds."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = 0.0
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body.update(extra)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{stack.api_url}/chat/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for raw in response.content:
            if raw.startswith(b"data: {") and b'"content"' in raw and not first:
                first = loop.time() - started
    assert first > 0
    return first


async def preload(double: str, served: str) -> None:
    """Load a model on a double the way an operator would (Ollama's load call)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{double}/api/generate", json={"model": served}) as response,
    ):
        assert response.status == 200, await response.text()


def two_hosts(a: str, b: str) -> dict[str, object]:
    """One model, ``chat``, served as ``llama3`` by an Ollama on each node."""
    return {
        "models": [{"id": "chat", "providers": {"a-ollama": "llama3", "b-ollama": "llama3"}}],
        "nodes": [
            {"id": "node-a", "providers": [ollama("a-ollama", a, ["llama3"])]},
            {"id": "node-b", "providers": [ollama("b-ollama", b, ["llama3"])]},
        ],
    }


@pytest.fixture
async def hosts(tmp_path: Path, start_stack_factory: Any) -> AsyncIterator[tuple[Any, str, str]]:
    """Two Ollama doubles (a 1.5 s load), one per node, behind one model; nothing loaded."""
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(spawned("--models", "llama3", "--load-s", LOAD_S))
        b = await stack.enter_async_context(spawned("--models", "llama3", "--load-s", LOAD_S))
        running = await stack.enter_async_context(start_stack_factory(tmp_path, two_hosts(a, b)))
        yield running, a, b


async def test_a_warm_provider_is_preferred_over_a_cold_one(hosts: tuple[Any, str, str]) -> None:
    stack, a, b = hosts
    # b's Ollama holds the model (loaded outside the edge); a's, listed first, does not.
    await preload(b, "llama3")

    async def b_warm() -> bool:
        return bool((await warm_row(stack, "b-ollama", "llama3"))["warm"])

    await eventually(b_warm)  # the node read it from /api/ps and told the edge
    assert (await warm_row(stack, "a-ollama", "llama3"))["warm"] is False
    for _ in range(4):  # one at a time: both providers idle, equal load each time
        await chat(stack, "chat")
    # Every request went to the warm host: the cold one (first in the fleet's order, which
    # the seed's rule picks on ties) never loaded.
    assert await loads(a) == {}
    assert await loads(b) == {"llama3": 1}  # the preload only

    # Ollama unloads a model after its keep_alive: the node sees it gone, and so does the
    # edge, which no longer counts b warm; the next request costs a load again.
    await chat(stack, "chat", keep_alive="1s")

    async def b_cold() -> bool:
        return not (await warm_row(stack, "b-ollama", "llama3"))["warm"]

    await eventually(b_cold)
    await chat(stack, "chat")
    assert sum((await loads(a)).values()) + sum((await loads(b)).values()) == 2


async def test_a_burst_to_a_cold_model_loads_it_once_and_the_catalog_shows_the_load(
    hosts: tuple[Any, str, str],
) -> None:
    stack, a, b = hosts
    row = await warm_row(stack, "a-ollama", "llama3")
    assert (row["warm"], row["last_load_ms"]) == (False, None)
    ttfts = await asyncio.gather(*(chat(stack, "chat") for _ in range(8)))
    assert len(ttfts) == 8
    # One host loaded the model; the edge held the other requests for it rather than
    # starting a load on the other host (each host had free slots for four).
    counts = [await loads(a), await loads(b)]
    assert sorted(sum(c.values()) for c in counts) == [0, 1], counts
    loaded_on = "a-ollama" if counts[0] else "b-ollama"
    cold = "b-ollama" if counts[0] else "a-ollama"

    async def shown() -> bool:
        warm = await warm_row(stack, loaded_on, "llama3")
        return bool(warm["warm"]) and (warm["last_load_ms"] or 0) >= 1000

    await eventually(shown)  # the load time as the answer reported it (load_duration)
    warm = await warm_row(stack, loaded_on, "llama3")
    assert warm["loads"] == 1
    assert warm["mean_load_ms"] == warm["last_load_ms"]
    assert (await warm_row(stack, cold, "llama3"))["warm"] is False
    models = (await get(stack.api_url.replace("/v1", "/iop/v1/catalog/models")))["data"]
    assert next(m for m in models if m["id"] == "chat")["warm_providers"] == [loaded_on]
    assert (await provider_row(stack, loaded_on))["warmth"]["on_demand"] is True


@pytest.fixture
async def swapping(tmp_path: Path, start_stack_factory: Any) -> AsyncIterator[tuple[Any, str]]:
    """One Ollama double that holds one model at a time (two served), each answer taking
    0.3 s, on node-a; node-b has no provider."""
    async with AsyncExitStack() as stack:
        double = await stack.enter_async_context(
            spawned("--models", "x,y", "--load-s", LOAD_S, "--max-loaded", "1", "--token-s", "0.06")
        )
        provider = ollama("swap", double, ["x", "y"], capacity=2, max_loaded_models=1)
        fleet = {
            "models": [
                {"id": "model-x", "providers": {"swap": "x"}},
                {"id": "model-y", "providers": {"swap": "y"}},
            ],
            "nodes": [{"id": "node-a", "providers": [provider]}, {"id": "node-b", "providers": []}],
        }
        edge = {"warm": {"group_grants": 3, "group_wait_s": 30}}
        running = await stack.enter_async_context(start_stack_factory(tmp_path, fleet, edge))
        yield running, double


async def test_a_swapping_host_groups_requests_by_model_and_no_model_starves(
    swapping: tuple[Any, str],
) -> None:
    stack, double = swapping
    await preload(double, "x")

    async def x_warm() -> bool:
        return bool((await warm_row(stack, "swap", "x"))["warm"])

    await eventually(x_warm)
    done: list[str] = []

    async def request(model: str) -> None:
        await chat(stack, model)
        done.append(model)

    # x and y requests arrive interleaved while the host holds x: y's requests wait at the
    # edge, grouped, rather than making the host swap back and forth.
    tasks = []
    for _ in range(4):
        tasks.append(asyncio.create_task(request("model-x")))
        tasks.append(asyncio.create_task(request("model-y")))
        await asyncio.sleep(0.05)
    for _ in range(8):  # a steady stream of x after them
        tasks.append(asyncio.create_task(request("model-x")))
    await asyncio.gather(*tasks)
    counts = await loads(double)
    # x: the preload, and once back after y's group; y: once. Swapping per request would
    # have loaded each many times.
    assert counts["y"] == 1, counts
    assert counts["x"] <= 2, counts
    # No starvation: y's group was served after at most a few of x's freed slots (the
    # bound is 3 in a row), not after every x request waiting behind them.
    assert done.index("model-y") < len(done) - 1 - done[::-1].index("model-x"), done
    assert done[-1] == "model-x", done


async def test_the_ollama_adapter_reports_what_the_double_holds_and_its_load_times() -> None:
    """The node's half alone: the Ollama adapter's account of loaded models (``/api/ps``
    at each probe) and load times (``load_duration`` of its answers) against the double."""
    async with spawned("--models", "x,y", "--load-s", "0.5", "--max-loaded", "1") as url:
        config = ProviderConfig(
            id="o", type="ollama", settings={"endpoint": url, "max_loaded_models": 1}
        )
        async with aiohttp.ClientSession() as http:
            adapter = OllamaAdapter(config, AdapterContext(http=http, environ={}))

            async def run(model: str) -> None:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                spec = ExecutionSpec(
                    run_id=f"run-{model}",
                    model=model,
                    provider_id="o",
                    adapter="ollama",
                    target=model,
                    operation=Operation.CHAT_COMPLETIONS,
                    body_json=json_codec.dumps(body),
                    stream=True,
                    include_usage=True,
                    deadline=asyncio.get_running_loop().time() + 30,
                )
                await adapter.execute(spec, RecordingSink())

            assert (await adapter.probe()).ok
            assert adapter.load_state().models == ()  # nothing loaded yet
            await run("x")  # cold: a load
            state = adapter.load_state()
            assert [m.name for m in state.models] == ["x"]
            (timing,) = state.timings
            assert (timing.name, timing.loads) == ("x", 1)
            assert timing.last_ms >= 500
            await run("x")  # warm: no load counted
            assert adapter.load_state().timings[0].loads == 1
            await run("y")  # one model at a time: y replaces x
            assert [m.name for m in adapter.load_state().models] == ["y"]
            assert (await adapter.probe()).ok  # /api/ps agrees, with the expiry
            (loaded,) = adapter.load_state().models
            assert loaded.name == "y"
            assert loaded.expires_ms > loaded.since_ms > 0
            assert adapter.load_state().max_loaded == 1


@pytest.fixture
async def slow_answers(tmp_path: Path, start_stack_factory: Any) -> AsyncIterator[tuple[Any, str]]:
    """One Ollama double on node-a (node-b has no provider): a 1.5 s load, then each answer
    streams its five tokens a second apart. The node probes rarely (30 s): what the edge
    knows of the load comes from the runs it carries, not from a probe of ``/api/ps``."""
    async with AsyncExitStack() as stack:
        double = await stack.enter_async_context(
            spawned("--models", "llama3", "--load-s", LOAD_S, "--token-s", "1")
        )
        fleet = {
            "models": [{"id": "chat", "providers": {"only": "llama3"}}],
            "nodes": [
                {"id": "node-a", "providers": [ollama("only", double, ["llama3"])]},
                {"id": "node-b", "providers": []},
            ],
        }
        running = await stack.enter_async_context(
            start_stack_factory(tmp_path, fleet, node_settings={"probes": {"interval_s": 30}})
        )
        yield running, double


async def streamed(stack: Any, model: str) -> tuple[float, float]:
    """One streamed chat request through the edge: when (the loop's clock) its first
    token and its last byte arrived."""
    loop = asyncio.get_running_loop()
    first = 0.0
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{stack.api_url}/chat/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for raw in response.content:
            if raw.startswith(b"data: {") and b'"content"' in raw and not first:
                first = loop.time()
    assert first > 0
    return first, loop.time()


async def test_the_requests_held_for_a_load_start_at_its_first_token_not_its_end(
    slow_answers: tuple[Any, str],
) -> None:
    stack, double = slow_answers
    assert (await warm_row(stack, "only", "llama3"))["warm"] is False
    # A burst to the cold model: one request loads it, the others are held for that load.
    times = await asyncio.gather(*(streamed(stack, "chat") for _ in range(4)))
    assert await loads(double) == {"llama3": 1}
    # The loading run answers first (its first token right after the load); it streams
    # for four more seconds. The held requests went when its first token came (the model
    # in memory), so theirs came a second later, seconds before its end; held until its
    # end, as before, each first token would come after it.
    loading_first, loading_end = min(times)
    held = sorted(times)[1:]
    assert all(first < loading_end for first, _ in held), (times, loading_end)
    assert loading_first < min(first for first, _ in held)
