"""A storm of 100 clients that hang up at random points, and what it must leave behind: nothing.

Each client is cut (seeded plan) while queued at the edge, after its run was
dispatched but before the first token, in the middle of a stream, or while
waiting for a non-streaming answer, by cancelling its task, closing its
response or connection, or resetting its socket. Afterwards every run that
reached a node was cancelled there (none completed), nothing is in flight or
queued, and the edge's and the nodes' open fds, sockets and asyncio tasks are
back to where they were: a disconnect that leaks a socket or a task per
client would show here a hundred times over.

The storm comes in waves so that each cut point is reached for sure: the
wave's slot holders are dispatched first, then its queued clients fill the
queue, then everyone in the wave hangs up at a random moment. Where a cut
really happened is read back from the edge's own run records, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "storm"
CAPACITY = 4  # per provider: 8 slots in all
WAVES = 5
HOLDERS = 2 * CAPACITY  # per wave: one client per slot
QUEUED = 12  # per wave: waiting behind the holders
CLIENTS = WAVES * (HOLDERS + QUEUED)
LONG_TOKENS = 4000  # 20 s at 200 tokens/s: no run can finish before it is cut
SLOW_FIRST_TOKEN_MS = 60_000
WAVE_WITHIN_S = 19
PROCESS_GAUGES = ("process_open_fds", "iop_open_sockets", "iop_asyncio_tasks")
TOLERANCE = 3  # fds, sockets or tasks above the baseline still counted as "back"
HOLDER_POINTS = ("before_first_token", "mid_stream", "non_streaming")
METHODS = ("cancel", "close", "reset")


MOCK = {
    "capacity": CAPACITY,
    "max_queue": 40,
    "queue_timeout_ms": 60_000,
    "request_timeout_ms": 60_000,
    "tokens_per_second": 200,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, faults: Any
) -> AsyncIterator[Any]:
    fleet = faults.pool_fleet(MODEL, "storm", **MOCK)
    root = Path(tmp_path_factory.mktemp("storm"))
    async with start_stack_factory(root, fleet) as running:
        yield running


@dataclass
class Plan:
    """One client: where it means to be cut, how, and when (all drawn from the seed)."""

    index: int
    point: str  # queued | before_first_token | mid_stream | non_streaming
    method: str  # cancel | close | reset
    delay_s: float  # after the wave's go, before the cut
    chunks: int  # mid_stream: chunks read after the go before the cut
    body: dict[str, Any] = field(default_factory=dict)


def make_plans(rng: random.Random) -> list[list[Plan]]:
    waves: list[list[Plan]] = []
    index = 0
    for _ in range(WAVES):
        # every wave holds each kind of slot at least twice, the rest drawn at random
        points = [*HOLDER_POINTS, *HOLDER_POINTS]
        points += [rng.choice(HOLDER_POINTS) for _ in range(HOLDERS - len(points))]
        points += ["queued"] * QUEUED
        wave = []
        for point in points:
            # a queued client's body is one of the long kinds: if it is handed a slot
            # in the moment before its cut, its run still cannot finish first
            kind = rng.choice(HOLDER_POINTS) if point == "queued" else point
            wave.append(
                Plan(
                    index=index,
                    point=point,
                    method=rng.choice(METHODS),
                    delay_s=rng.uniform(0.0, 0.5),
                    chunks=rng.randrange(1, 40),
                    body=request_body(index, kind),
                )
            )
            index += 1
        waves.append(wave)
    return waves


def request_body(index: int, kind: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"storm client {index}"}],
        "max_tokens": LONG_TOKENS,
        "stream": kind != "non_streaming",
        "iop_mock": {"fill": True},  # LONG_TOKENS tokens, not the mock's short answer
    }
    if kind == "before_first_token":
        body["iop_mock"]["delay_ms"] = SLOW_FIRST_TOKEN_MS
    return body


class Client:
    """One storm client; ``reached`` is set once it is where its cut is due."""

    def __init__(self, plan: Plan, api_url: str, go: asyncio.Event) -> None:
        self.plan = plan
        self.url = f"{api_url}/chat/completions"
        self.go = go
        self.first_chunk = asyncio.Event()
        self.reached = asyncio.Event()

    async def run(self) -> None:
        if self.plan.method == "reset":
            await self._run_raw()
        else:
            await self._run_aiohttp()

    async def _wait_for_cut(self) -> None:
        await self.go.wait()
        await asyncio.sleep(self.plan.delay_s)
        await self.reached.wait()

    async def _run_aiohttp(self) -> None:
        async with aiohttp.ClientSession() as http:  # one each: "close" closes this connection
            talk = asyncio.create_task(self._talk(http))
            try:
                await self._wait_for_cut()
            finally:
                if self.plan.method == "cancel":
                    talk.cancel()
                elif not talk.done():
                    await http.close()  # the connection goes, mid-request
                await asyncio.gather(talk, return_exceptions=True)

    async def _talk(self, http: aiohttp.ClientSession) -> None:
        try:
            await self._talk_until_cut(http)
        finally:
            # A stream that ended before its cut point (an error event) must not hold the
            # wave until its deadline: the counts after the storm show what it did.
            self.reached.set()

    async def _talk_until_cut(self, http: aiohttp.ClientSession) -> None:
        if self.plan.point != "mid_stream":
            self.reached.set()  # its point is "still waiting": any moment after the go
        async with http.post(self.url, json=self.plan.body) as response:
            assert response.status == 200, await response.text()
            count = 0
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                self.first_chunk.set()
                await self.go.wait()
                count += 1
                if count >= self.plan.chunks:
                    self.reached.set()
                    break
            if self.plan.method == "close":
                response.close()  # mid-stream: the client closes the response
                return
            await asyncio.get_running_loop().create_future()  # hold on until cut

    async def _run_raw(self) -> None:
        """A socket that sends its request and later resets the connection (RST)."""
        host, port = self.url.removeprefix("http://").split("/", 1)[0].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps(self.plan.body).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload)
        )
        read = asyncio.create_task(self._read_raw(reader))
        try:
            if self.plan.point != "mid_stream":
                self.reached.set()
            await self._wait_for_cut()
        finally:
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # with a zero linger: a reset, not a polite FIN
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _read_raw(self, reader: asyncio.StreamReader) -> None:
        received = b""
        at_go = -1
        while chunk := await reader.read(65536):
            received += chunk
            events = received.count(b"data: ")
            if events:
                self.first_chunk.set()
            if self.go.is_set():
                at_go = events if at_go < 0 else at_go
                if events - at_go >= self.plan.chunks:
                    self.reached.set()
                    break
        await asyncio.get_running_loop().create_future()  # hold on until cut


async def scrape(http: aiohttp.ClientSession, admin_url: str) -> dict[str, float]:
    """Unlabelled gauges plus ``name{label=value,...}`` keys for labelled samples."""
    async with http.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def total(values: dict[str, float], name: str, **labels: str) -> float:
    wanted = [f"{k}={v}" for k, v in labels.items()]
    return sum(
        value
        for key, value in values.items()
        if key.startswith(name + "{") and all(w in key for w in wanted)
    )


async def process_gauges(stack: Any) -> dict[str, dict[str, float]]:
    gauges: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as http:
        for name in ("edge", "node-a", "node-b"):
            values = await scrape(http, stack.services[name].admin_url)
            gauges[name] = {gauge: values[gauge] for gauge in PROCESS_GAUGES}
    return gauges


def describe_gauges(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> str:
    return "; ".join(
        f"{name} "
        + ", ".join(
            f"{gauge} {before[name][gauge]:.0f}->{after.get(name, {}).get(gauge, -1):.0f}"
            for gauge in PROCESS_GAUGES
        )
        for name in before
    )


async def node_runs(stack: Any) -> Counter[str]:
    runs: Counter[str] = Counter()
    async with aiohttp.ClientSession() as http:
        for node in ("node-a", "node-b"):
            values = await scrape(http, stack.services[node].admin_url)
            for outcome in ("completed", "failed", "cancelled", "rejected"):
                runs[outcome] += int(total(values, "iop_node_runs_total", outcome=outcome))
            runs["in_flight"] += int(total(values, "iop_node_provider_in_flight"))
            runs["queued"] += int(total(values, "iop_node_provider_queued"))
    return runs


async def edge_load(faults: Any, api_url: str) -> tuple[int, int]:
    providers = await faults.catalog(api_url, "providers")
    models = await faults.catalog(api_url, "models")
    return sum(p["in_flight"] for p in providers), sum(m["queued"] for m in models)


async def load_is(
    faults: Any, api_url: str, in_flight: int, queued: int, streaming: list[Client] | None = None
) -> bool:
    """The edge's catalog shows this many runs in flight and waiting (and these clients
    have their first chunk)."""
    if not all(client.first_chunk.is_set() for client in streaming or []):
        return False
    return await edge_load(faults, api_url) == (in_flight, queued)


def observed_point(record: dict[str, Any]) -> str:
    """Where the edge says the client left: the run record's own facts."""
    if not record["provider_id"]:
        return "queued"
    if not record["stream"]:
        return "non_streaming"
    return "mid_stream" if record["ttft_ms"] else "before_first_token"


async def test_disconnect_storm_leaves_nothing_behind(
    stack: Any, faults: Any, report: Callable[[str], None]
) -> None:
    eventually = faults.eventually
    waves = make_plans(random.Random(20260505))
    plans = [plan for wave in waves for plan in wave]
    assert len(plans) == CLIENTS
    await eventually(lambda: _settled(stack, faults))
    # One request first, so what opens on first use is in the baseline. The edge's run log
    # still opens its WAL files at its first flush, 250 ms later: +2 fds the tolerance takes.
    warm_up = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        assert (await faults.stream_chat(http, stack.api_url, warm_up, 10)).kind == "completed"
    baseline = await process_gauges(stack)
    runs_before = await node_runs(stack)
    started_ms = int(time.time() * 1000)
    started = time.monotonic()

    for wave in waves:
        go = asyncio.Event()
        clients = [Client(plan, stack.api_url, go) for plan in wave]
        holders = [c for c in clients if c.plan.point != "queued"]
        queued = [c for c in clients if c.plan.point == "queued"]
        tasks = [asyncio.create_task(c.run()) for c in holders]

        # the holders have their slots (and the streaming ones their first chunk) ...
        streaming = [c for c in holders if c.plan.point == "mid_stream"]
        await eventually(functools.partial(load_is, faults, stack.api_url, HOLDERS, 0, streaming))
        tasks += [asyncio.create_task(c.run()) for c in queued]
        # ... then the others wait in the model's queue behind them
        await eventually(functools.partial(load_is, faults, stack.api_url, HOLDERS, QUEUED))
        go.set()
        # Each client is cut within half a second and 40 chunks of the go; a client whose
        # stream ended first no longer holds the wave. The bound stays below the 20 s a
        # run would take to end.
        async with asyncio.timeout(WAVE_WITHIN_S):
            results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        await eventually(functools.partial(load_is, faults, stack.api_url, 0, 0))
    storm_s = time.monotonic() - started

    async def records_written() -> bool:
        return len(await _storm_records(stack, started_ms)) == CLIENTS

    await eventually(records_written)
    records = await _storm_records(stack, started_ms)
    dispatched = sum(1 for r in records if r["provider_id"])

    async def nodes_done() -> bool:
        runs = await node_runs(stack)
        return runs["in_flight"] == 0 and runs["cancelled"] - runs_before["cancelled"] >= dispatched

    await eventually(nodes_done)
    runs_after = await node_runs(stack)
    runs = {k: runs_after[k] - runs_before[k] for k in ("completed", "failed", "cancelled")}
    settle_started = time.monotonic()
    after: dict[str, dict[str, float]] = {}

    async def back_to_baseline() -> bool:
        after.update(await process_gauges(stack))
        return all(
            after[name][gauge] <= baseline[name][gauge] + TOLERANCE
            for name in baseline
            for gauge in PROCESS_GAUGES
        )

    observed = Counter(map(observed_point, records))
    try:
        await eventually(back_to_baseline, timeout_s=20)
    finally:
        report(
            f"{CLIENTS} clients in {WAVES} waves, {storm_s:.1f}s; planned cut points "
            f"{dict(Counter(p.point for p in plans))}, methods "
            f"{dict(Counter(p.method for p in plans))}"
        )
        report(
            f"cut points per the edge's run records {dict(observed)}; outcomes "
            f"{dict(Counter(r['outcome'] for r in records))}; statuses "
            f"{dict(Counter(r['status'] for r in records))}"
        )
        report(
            f"node runs during the storm {runs} (edge dispatched {dispatched}); now in flight "
            f"{runs_after['in_flight']}, queued {runs_after['queued']}"
        )
        report(
            f"baseline->after ({time.monotonic() - settle_started:.1f}s to settle): "
            + describe_gauges(baseline, after)
        )

    assert all(r["outcome"] == "cancelled" for r in records), Counter(r["outcome"] for r in records)
    for point in ("queued", *HOLDER_POINTS):
        assert observed[point] >= WAVES, observed  # every cut point was really reached
    assert runs["cancelled"] == dispatched  # every provider call that began was aborted
    assert runs["completed"] == runs["failed"] == 0
    assert runs_after["in_flight"] == runs_after["queued"] == 0
    assert await edge_load(faults, stack.api_url) == (0, 0)
    for name, service in stack.services.items():
        assert service.process.returncode is None, name
        assert "Traceback" not in "".join(service.log), name  # every cut is an expected path


async def _settled(stack: Any, faults: Any) -> bool:
    providers = await faults.catalog(stack.api_url, "providers")
    return len(providers) == 2 and all(p["health"] == "available" for p in providers)


async def _storm_records(stack: Any, since_ms: int) -> list[dict[str, Any]]:
    url = stack.api_url.replace("/v1", "/iop/v1/runs") + "?limit=1000"
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            data = (await response.json())["data"]
    return [r for r in data if r["model"] == MODEL and r["received_ms"] >= since_ms]
