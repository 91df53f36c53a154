"""Issue 32: fair queueing across keys, priorities, and batch lines as backfill, measured.

    .venv/bin/python tools/hardening/fair_sharing.py [--flood 200] [--lines 500]

Starts the test stack (tests/conftest.py ``start_stack``: control-plane, edge, node-a,
node-b and the worker as processes, mTLS, port 0) with ``FLEET`` below: model ``fair``
on one mock slot, model ``backfill`` on one mock provider with four; every request
takes the same fixed time on the mock (``default_tokens`` at ``tokens_per_second``),
so the figures are scheduling, not engine speed. Keys ``a``, ``b`` and an operator
key ``op`` are issued with the control-plane's CLI. Then:

1. **burst**: key a sends ``--flood`` requests to ``fair`` (in waves, each queued at
   the edge before the next is sent), then key b sends one: how many of a's requests
   were served while b's waited, and b's wait (today's FIFO: all of a's queue);
2. **priority**: key a floods again; ``op`` sends one with ``x-iop-priority: 10``: a's
   requests served while it waited; and key b's answer when it sends the header;
3. **backfill**: three interactive clients stream requests to ``backfill``, first
   alone, then while a batch of ``--lines`` lines (made by key a) runs: time to first
   token (client side) and the edge's ``x-iop-overhead-ms`` (queueing included), p50
   and p90 each; then the batch's end: every line done exactly once;
4. **weights**: keys ``heavy`` (weight 3) and ``light`` (weight 1) each send
   ``--flood`` / 2 requests to ``fair``, interleaved: of the first 80 answered once all
   arrived, how many were each key's (today's FIFO: about 1:1).

The control-plane's CLI does not set a key's weight or priority in this checkout, so
they reach the edge the way every key's policy does, in the fleet config, written on
its way: ``PolicyRelay`` (the control-plane's certificate towards the edge, the edge's
towards the real control-plane, real mTLS both ways) sets ``POLICIES`` on the keys it
names and passes every other frame as it is; the edge is restarted onto it.

Runs against whichever checkout the venv imports (``PYTHONPATH`` of another
checkout's ``src`` folders measures that one): the same script before and after.
The e2e test tests/e2e/test_fair_sharing.py asserts on the same scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from iop_proto.errors import ConnectionClosed
from iop_proto.framing import read_frame, write_frame
from iop_proto.tls import client_context, server_context

ROOT = Path(__file__).resolve().parents[2]

Stack = Any  # tests/conftest.py's Stack


def mock(provider_id: str, served: str, capacity: int) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": capacity,
        "max_queue": 600,
        "queue_timeout_ms": 120_000,
        "request_timeout_ms": 120_000,
        "tokens_per_second": 50,  # 4 tokens: 80 ms a request, the first token at once
        "default_tokens": 4,
    }


FLEET: dict[str, object] = {
    "models": [
        {"id": "fair", "providers": {"node-a-fair": "fair-served"}},
        {"id": "backfill", "providers": {"node-b-bf": "bf-served"}},
    ],
    "nodes": [
        {"id": "node-a", "providers": [{**mock("node-a-fair", "fair-served", 1)}]},
        {"id": "node-b", "providers": [mock("node-b-bf", "bf-served", 4)]},
        {"id": "node-fuzz", "providers": []},
    ],
}
POLICIES = {"heavy": (3, 0), "light": (1, 0), "urgent": (1, 5)}  # name: (weight, priority)
FAIR_TOKENS = 1  # the burst's requests: 20 ms each on the one slot
PRIORITY_HEADER = "x-iop-priority"


@dataclass
class Keys:
    a: str
    b: str
    op: str


async def issue_keys(stack: Stack) -> Keys:
    return Keys(
        await stack.issue_key("a"),
        await stack.issue_key("b"),
        await stack.issue_key("op", "--operator"),
    )


class PolicyRelay:
    """Between the edge and the control-plane: sets ``POLICIES`` on the fleet configs."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        context = server_context(self._stack.tls("control-plane"))
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(
            "127.0.0.1",
            self._stack.cp_port,
            ssl=client_context(self._stack.tls("edge")),
            server_hostname="localhost",
        )
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, rewrite=False)),
            asyncio.create_task(self._pump(up_reader, writer, rewrite=True)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for end in (writer, up_writer):
            end.close()

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, rewrite: bool
    ) -> None:
        with contextlib.suppress(ConnectionClosed, ConnectionError, OSError):
            while True:
                envelope = await read_frame(reader)
                if rewrite and envelope.WhichOneof("body") == "fleet_config":
                    for key in envelope.fleet_config.api_keys:
                        if key.name in POLICIES:
                            key.weight, key.priority = POLICIES[key.name]
                await write_frame(writer, envelope)


@contextlib.asynccontextmanager
async def relayed(stack: Stack) -> AsyncIterator[dict[str, str]]:
    """The stack's edge restarted onto a ``PolicyRelay``; the keys of ``POLICIES`` issued."""
    relay = PolicyRelay(stack)
    port = await relay.start()
    try:
        await stack.stop("edge")
        path = stack.root / "edge.yaml"
        settings = yaml.safe_load(path.read_text())
        settings["control_plane"]["port"] = port
        path.write_text(yaml.safe_dump(settings))
        edge = await stack.start("edge")  # on its pinned ports: the nodes dial back
        stack.edge_admin = edge.admin_url  # the admin port is a new one
        await stack.wait_registered(("node-a", "node-b", "worker"), timeout_s=30)
        yield {name: await stack.issue_key(name) for name in POLICIES}
    finally:
        await relay.close()


async def weights_scenario(stack: Stack, keys: dict[str, str], n: int) -> dict[str, Any]:
    async with session() as http:
        tasks: dict[asyncio.Task[tuple[int, float]], str] = {}
        for i in range(n):  # sent interleaved: a FIFO serves them 1:1
            for name in ("heavy", "light"):
                payload = body("fair", f"{name}-{i}", max_tokens=FAIR_TOKENS)
                tasks[asyncio.create_task(ask(http, stack, keys[name], payload))] = name

        async def all_arrived() -> bool:
            held = await queued(http, stack, "fair")
            return held + sum(t.done() for t in tasks) + 1 >= len(tasks)

        await until(all_arrived)
        since = time.monotonic()
        await asyncio.gather(*tasks)
    answered = sorted((t.result()[1], name) for t, name in tasks.items() if t.result()[1] > since)
    window = [name for _, name in answered[:80]]  # while both keys still wait
    return {
        "statuses": sorted({t.result()[0] for t in tasks}),
        "heavy_of_first_80": window.count("heavy"),
        "light_of_first_80": window.count("light"),
    }


async def key_priority_scenario(stack: Stack, keys: dict[str, str], n: int) -> dict[str, Any]:
    async with session() as http:
        burst = await flood(http, stack, keys["light"], n, waves=1)
        sent_at = time.monotonic()
        payload = body("fair", "urgent", max_tokens=FAIR_TOKENS)
        status, answered_at = await ask(http, stack, keys["urgent"], payload)
        served = burst.served_between(sent_at, answered_at)
        await asyncio.gather(*burst.tasks)
    return {"urgent_status": status, "light_served_while_urgent_waited": served}


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def body(model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], **extra}


async def ask(
    http: aiohttp.ClientSession,
    stack: Stack,
    key: str,
    payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, float]:
    """(status, when the answer was read, monotonic)."""
    async with http.post(
        f"{stack.api_url}/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    ) as response:
        await response.read()
        return response.status, time.monotonic()


async def queued(http: aiohttp.ClientSession, stack: Stack, model: str) -> int:
    async with http.get(f"{stack.edge_admin}/metrics") as response:
        text = await response.text()
    found = re.search(rf'^iop_edge_model_queued\{{model="{model}"\}} (\S+)$', text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


async def preemptions(stack: Stack, model: str) -> int:
    """``iop_edge_batch_preemptions_total`` of ``model`` (0 where the edge has none)."""
    async with session() as http, http.get(f"{stack.edge_admin}/metrics") as response:
        text = await response.text()
    pattern = rf'^iop_edge_batch_preemptions_total\{{model="{model}"\}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    """Poll another process's state until ``check`` holds."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in another process
            await asyncio.sleep(0.02)


@dataclass
class Flood:
    """One key's burst on ``fair``: each request's wave and when its answer came."""

    tasks: list[asyncio.Task[tuple[int, float]]] = field(default_factory=list)
    waves: list[int] = field(default_factory=list)

    def done(self) -> int:
        return sum(t.done() for t in self.tasks)

    def served_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.tasks if t.done() and start < t.result()[1] <= end)

    def waves_in_order(self) -> bool:
        """Every wave's answers came before the next wave's (FIFO within the key)."""
        last = max(self.waves) if self.waves else 0
        for wave in range(last):
            mine = [t.result()[1] for t, w in zip(self.tasks, self.waves, strict=True) if w == wave]
            later = [
                t.result()[1] for t, w in zip(self.tasks, self.waves, strict=True) if w == wave + 1
            ]
            if mine and later and max(mine) > min(later):
                return False
        return True


async def flood(
    http: aiohttp.ClientSession, stack: Stack, key: str, n: int, waves: int = 4
) -> Flood:
    """``n`` requests of ``key`` to ``fair``, in ``waves``: each wave is sent once the
    edge holds the one before (queued, running, or answered), so arrival order is known."""
    burst = Flood()
    size = max(1, n // waves)
    for wave, start in enumerate(range(0, n, size)):
        for i in range(start, min(n, start + size)):
            payload = body("fair", f"{key[-6:]}-{i}", max_tokens=FAIR_TOKENS)
            burst.tasks.append(asyncio.create_task(ask(http, stack, key, payload)))
            burst.waves.append(wave)
        sent = len(burst.tasks)

        async def arrived(sent: int = sent) -> bool:
            return await queued(http, stack, "fair") + burst.done() + 1 >= sent

        await until(arrived)
    return burst


async def burst_scenario(stack: Stack, keys: Keys, n: int) -> dict[str, Any]:
    async with session() as http:
        burst = await flood(http, stack, keys.a, n)
        waiting = await queued(http, stack, "fair")
        sent_at = time.monotonic()
        status, answered_at = await ask(http, stack, keys.b, body("fair", "b", max_tokens=1))
        served = burst.served_between(sent_at, answered_at)
        await asyncio.gather(*burst.tasks)
        return {
            "a_queued_when_b_sent": waiting,
            "a_served_while_b_waited": served,
            "b_wait_s": round(answered_at - sent_at, 3),
            "b_status": status,
            "a_statuses": sorted({t.result()[0] for t in burst.tasks}),
            "a_fifo_by_wave": burst.waves_in_order(),
        }


async def priority_scenario(stack: Stack, keys: Keys, n: int) -> dict[str, Any]:
    async with session() as http:
        refused, _ = await ask(
            http, stack, keys.b, body("fair", "b", max_tokens=1), {PRIORITY_HEADER: "10"}
        )
        burst = await flood(http, stack, keys.a, n, waves=1)
        sent_at = time.monotonic()
        status, answered_at = await ask(
            http, stack, keys.op, body("fair", "op", max_tokens=1), {PRIORITY_HEADER: "10"}
        )
        served = burst.served_between(sent_at, answered_at)
        await asyncio.gather(*burst.tasks)
        return {
            "operator_status": status,
            "a_served_while_operator_waited": served,
            "operator_wait_s": round(answered_at - sent_at, 3),
            "b_with_header_status": refused,
        }


async def stream_once(
    http: aiohttp.ClientSession, stack: Stack, key: str, prompt: str
) -> tuple[float, float]:
    """(time to first token in ms, the edge's x-iop-overhead-ms) of one streamed request."""
    began = time.monotonic()
    payload = body("backfill", prompt, stream=True)
    async with http.post(
        f"{stack.api_url}/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        assert response.status == 200, await response.text()
        overhead = float(response.headers.get("x-iop-overhead-ms", "nan"))
        ttft = 0.0
        async for raw in response.content:
            if raw.startswith(b"data: ") and b'"content"' in raw and not ttft:
                ttft = (time.monotonic() - began) * 1000
        return ttft, overhead


async def interactive(stack: Stack, key: str, clients: int, each: int) -> dict[str, float]:
    async with session() as http:

        async def client(c: int) -> list[tuple[float, float]]:
            return [await stream_once(http, stack, key, f"i{c}-{i}") for i in range(each)]

        results = [r for rs in await asyncio.gather(*map(client, range(clients))) for r in rs]
    ttfts = sorted(r[0] for r in results)
    overheads = sorted(r[1] for r in results)
    return {
        "ttft_p50_ms": round(statistics.median(ttfts), 1),
        "ttft_p90_ms": round(ttfts[int(len(ttfts) * 0.9)], 1),
        "overhead_p50_ms": round(statistics.median(overheads), 1),
        "overhead_p90_ms": round(overheads[int(len(overheads) * 0.9)], 1),
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def run_batch(stack: Stack, key: str, lines: int) -> str:
    """Upload ``lines`` chat lines for ``backfill`` and start the batch; its id."""
    entries = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body("backfill", f"line {i}"),
        }
        for i in range(lines)
    ]
    auth = {"Authorization": f"Bearer {key}"}
    async with session() as http:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", jsonl(entries), filename="lines.jsonl")
        async with http.post(f"{stack.api_url}/files", data=form, headers=auth) as response:
            upload = await response.json()
        create = {
            "input_file_id": upload["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        async with http.post(f"{stack.api_url}/batches", json=create, headers=auth) as response:
            return str((await response.json())["id"])


async def batch_state(stack: Stack, key: str, batch_id: str) -> dict[str, Any]:
    async with session() as http:
        url = f"{stack.api_url}/batches/{batch_id}"
        async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as response:
            return dict(await response.json())


async def output_ids(stack: Stack, key: str, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    async with session() as http:
        url = f"{stack.api_url}/files/{file_id}/content"
        async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as response:
            text = await response.text()
    return [json.loads(line)["custom_id"] for line in text.splitlines() if line]


async def backfill_scenario(
    stack: Stack, keys: Keys, lines: int, clients: int = 3, each: int = 30
) -> dict[str, Any]:
    alone = await interactive(stack, keys.b, clients, each)
    batch_id = await run_batch(stack, keys.a, lines)

    async def started() -> bool:
        state = await batch_state(stack, keys.a, batch_id)
        return bool(state["request_counts"]["completed"] >= 4)

    await until(started)
    beside = await interactive(stack, keys.b, clients, each)
    during = (await batch_state(stack, keys.a, batch_id))["request_counts"]

    async def ended() -> bool:
        state = await batch_state(stack, keys.a, batch_id)
        return state["status"] in ("completed", "failed", "expired", "cancelled")

    await until(ended, timeout_s=240)
    state = await batch_state(stack, keys.a, batch_id)
    ids = await output_ids(stack, keys.a, state.get("output_file_id"))
    return {
        "alone": alone,
        "beside_batch": beside,
        "ttft_p50_ratio": round(beside["ttft_p50_ms"] / max(alone["ttft_p50_ms"], 1e-3), 2),
        "lines_done_while_interactive": during["completed"],
        "batch_runs_preempted": await preemptions(stack, "backfill"),
        "batch_status": state["status"],
        "batch_counts": state["request_counts"],
        "output_lines": len(ids),
        "output_unique": len(set(ids)),
        "output_complete": sorted(ids) == sorted(f"line-{i}" for i in range(lines)),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import start_stack  # the test stack, one copy of it

    with tempfile.TemporaryDirectory(prefix="fair-sharing-") as root:
        async with start_stack(Path(root), FLEET) as stack, relayed(stack) as weighted:
            keys = await issue_keys(stack)
            return {
                "burst": await burst_scenario(stack, keys, args.flood),
                "priority": await priority_scenario(stack, keys, args.flood // 2),
                "key_priority": await key_priority_scenario(stack, weighted, args.flood // 2),
                "weights": await weights_scenario(stack, weighted, args.flood // 2),
                "backfill": await backfill_scenario(stack, keys, args.lines),
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=200, help="key a's burst")
    parser.add_argument("--lines", type=int, default=500, help="the batch's lines")
    print(json.dumps(asyncio.run(measure(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
