"""Failure detection in seconds, with the default settings: a node frozen under load
(SIGSTOP) and a node host whose link is cut silently (a network namespace behind a veth
pair, the veth taken down) leave selection within 10 s.

Nothing here shortens a detection setting: heartbeats (2 s, 3 missed), the run
acknowledgement (2 s) and TCP keepalive are the edge's and the nodes' defaults.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

pytestmark = pytest.mark.asyncio(loop_scope="module")

DETECTION_BOUND_S = 10.0  # the bound: out of selection within this
EXTRA_BOUND_S = 10.0  # the bound: no request takes this much longer than normal
LOAD_S = 20.0
CLIENTS = 6  # more than node-a alone takes at the ratio of node-b's stuck runs: some go to node-b
RETRYABLE = {"provider_unavailable", "provider_timeout"}
MOCK = {
    "capacity": 4,
    "max_queue": 8,
    "queue_timeout_ms": 15_000,
    "request_timeout_ms": 30_000,
    "tokens_per_second": 20,
}
BODY = {"model": "pool", "messages": [{"role": "user", "content": "go"}], "max_tokens": 10}


@dataclass
class Answer:
    sent_at: float  # loop time
    duration_s: float
    status: int
    code: str = ""
    message: str = ""


@dataclass
class FrozenRun:
    """What the load saw while node-b was frozen."""

    normal_s: float  # median duration before the freeze
    detected_s: float  # from SIGSTOP to node-b's provider out of selection
    detected_at: float  # loop time
    answers: list[Answer]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, faults: Any
) -> AsyncIterator[Any]:
    fleet = faults.pool_fleet("pool", "mock", **MOCK)
    # node-b's provider also serves a model alone: a request that can only go to node-b.
    fleet["models"].append({"id": "only-b", "providers": {"node-b-mock": "pool-b"}})
    root = Path(tmp_path_factory.mktemp("detection"))
    # Nodes may dial in from a network namespace (the partition test): the node listener
    # takes every address. Nothing else differs from the defaults.
    edge = {"node_listener": {"host": "0.0.0.0", "port": 0}}
    async with start_stack_factory(root, fleet, edge_settings=edge) as running:
        yield running


async def ask(http: aiohttp.ClientSession, api_url: str, model: str = "pool") -> Answer:
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    body = {**BODY, "model": model}
    async with http.post(f"{api_url}/chat/completions", json=body) as response:
        payload = await response.json()
    error = payload.get("error") or {}
    code = "" if response.status == 200 else str(error.get("code") or "")
    return Answer(sent_at, loop.time() - sent_at, response.status, code, error.get("message", ""))


def out_of_selection(stack: Any, faults: Any, provider_id: str) -> Callable[[], Any]:
    async def check() -> bool:
        rows = {r["provider_id"]: r for r in await faults.catalog(stack.api_url, "providers")}
        row = rows[provider_id]
        return not (row["connected"] and row["health"] == "available")

    return check


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def frozen_run(stack: Any, faults: Any) -> AsyncIterator[FrozenRun]:
    """Six clients send non-streamed requests for 20 s; node-b is frozen (SIGSTOP) once
    both nodes are busy, and thawed (and registered again) after the load."""
    loop = asyncio.get_running_loop()
    node_b = stack.services["node-b"].process
    async with aiohttp.ClientSession() as http:
        normal = statistics.median([(await ask(http, stack.api_url)).duration_s for _ in range(4)])
        answers: list[Answer] = []
        stop_at = loop.time() + LOAD_S

        async def client() -> None:
            while loop.time() < stop_at:
                answers.append(await ask(http, stack.api_url))

        clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]

        async def both_busy() -> bool:
            rows = await faults.catalog(stack.api_url, "providers")
            return all(r["in_flight"] > 0 for r in rows)

        try:
            await faults.eventually(both_busy)
            os.kill(node_b.pid, signal.SIGSTOP)
            frozen_at = loop.time()
            await faults.eventually(out_of_selection(stack, faults, "node-b-mock"), 30)
            detected_at = loop.time()
            await asyncio.gather(*clients)
        finally:
            os.kill(node_b.pid, signal.SIGCONT)
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    await stack.wait_registered(("node-b",))
    yield FrozenRun(normal, detected_at - frozen_at, detected_at, answers)


async def test_a_frozen_node_leaves_selection_within_10_s_under_load(
    frozen_run: FrozenRun, report: Callable[[str], None]
) -> None:
    answers = frozen_run.answers
    failed = [a for a in answers if a.status != 200]
    slowest = max(a.duration_s for a in answers)
    report(
        f"normal {frozen_run.normal_s:.2f}s; node-b out of selection {frozen_run.detected_s:.1f}s"
        f" after SIGSTOP; {len(answers)} requests, {len(failed)} failed"
        f" {sorted({(a.status, a.code) for a in failed})}; slowest {slowest:.1f}s"
    )
    assert frozen_run.detected_s <= DETECTION_BOUND_S
    # What the frozen node held failed fast, with an error a failover may retry.
    assert {a.code for a in failed} <= RETRYABLE
    assert slowest <= frozen_run.normal_s + EXTRA_BOUND_S
    # Once it was out, nothing new went to it: every later request was answered.
    later = [a for a in answers if a.sent_at > frozen_run.detected_at]
    assert later
    assert all(a.status == 200 for a in later)


async def test_a_frozen_node_under_load_costs_no_request(
    frozen_run: FrozenRun, report: Callable[[str], None]
) -> None:
    answers = frozen_run.answers
    assert all(a.status == 200 for a in answers), [a for a in answers if a.status != 200]
    assert max(a.duration_s for a in answers) <= frozen_run.normal_s + EXTRA_BOUND_S


async def test_a_run_a_frozen_node_does_not_acknowledge_fails_and_takes_it_out(
    stack: Any, faults: Any, frozen_run: FrozenRun, report: Callable[[str], None]
) -> None:
    """Before its heartbeats are missed, the first run sent to a frozen node says so."""
    loop = asyncio.get_running_loop()
    node_b = stack.services["node-b"].process
    async with aiohttp.ClientSession() as http:
        assert (await ask(http, stack.api_url, "only-b")).status == 200
        os.kill(node_b.pid, signal.SIGSTOP)
        frozen_at = loop.time()
        try:
            answer = await ask(http, stack.api_url, "only-b")
            out = await out_of_selection(stack, faults, "node-b-mock")()
            after_s = loop.time() - frozen_at
            following = await ask(http, stack.api_url)
        finally:
            os.kill(node_b.pid, signal.SIGCONT)
    await stack.wait_registered(("node-b",))
    report(
        f"a run sent to frozen node-b: {answer.status} {answer.code} after"
        f" {answer.duration_s:.1f}s ({answer.message!r}); out of selection {out} at"
        f" {after_s:.1f}s; the next request: {following.status} in {following.duration_s:.2f}s"
    )
    assert (answer.status, answer.code) == (503, "provider_unavailable")
    assert answer.message == "node node-b did not acknowledge the run within 2 s"
    assert out  # at once, not at the heartbeat verdict
    assert following.status == 200
    assert following.duration_s < 2  # node-a's, without waiting for node-b


async def test_a_node_cut_off_silently_leaves_selection_within_10_s(
    stack: Any, faults: Any, netns_factory: Any, report: Callable[[str], None]
) -> None:
    loop = asyncio.get_running_loop()
    with netns_factory("d", 214) as ns:
        # node-b moves to "another host": the namespace, dialing the edge over the veth.
        await stack.stop("node-b")
        settings_file = stack.root / "node-b.yaml"
        settings = yaml.safe_load(settings_file.read_text())
        settings["edge"]["host"] = ns.host_address
        settings["admin"]["host"] = ns.client_address  # its /readyz, reached over the veth
        settings_file.write_text(yaml.safe_dump(settings))
        await stack.start("node-b", wrapper=ns.wrapper)
        try:
            await stack.wait_registered(("node-b",))
            ns.cut()
            cut_at = loop.time()
            await faults.eventually(out_of_selection(stack, faults, "node-b-mock"), 30)
            detected_s = loop.time() - cut_at
            async with aiohttp.ClientSession() as http:
                answers = [await ask(http, stack.api_url) for _ in range(4)]
        finally:
            await stack.stop("node-b", signal.SIGKILL)
    report(
        f"node-b out of selection {detected_s:.1f}s after its link was cut;"
        f" then {[(a.status, round(a.duration_s, 2)) for a in answers]}"
    )
    assert detected_s <= DETECTION_BOUND_S
    # Sent then, each request goes to node-a (node-b's provider could not answer it).
    assert all(a.status == 200 for a in answers)
    assert all(a.duration_s < DETECTION_BOUND_S for a in answers)
