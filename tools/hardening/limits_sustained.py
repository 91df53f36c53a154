"""Issue 31, a key's ``max_concurrent`` across two edges under sustained load, and after an
edge is SIGKILLed and started again: the figures of the checkout the venv imports
(``PYTHONPATH`` of another checkout's ``src`` folders measures that one; the processes
it starts inherit it).

Every process is real: a throwaway PostgreSQL cluster (``iop_proto.testing_postgres``),
a control-plane, two edges on it (``key_slot_ttl_s`` = ``--ttl``), one node dialling
both, ``tools/tcp_balancer.py`` in front of the edges, and the bench's fake engine
(tools/bench/fake_backend.py) holding each request ``--hold-ms``: it counts the
requests it answers at once, exactly (a time integral, not samples). ``--clients``
closed-loop clients (one connection per request, so the balancer spreads them over
both edges all along) send the key's requests; a 429 is retried after a short pause,
so demand always exceeds the limit.

1. **steady** (``--steady-s``): the most requests the engine answered at once (the
   limit must hold: peak <= limit, the issue's 10% of 4 being less than one) and the
   mean (the limit must be used: mean >= 0.9 x limit while demand exceeds it);
2. **churn**: edge-2 SIGKILLed under the same load. Its slots stay held in PostgreSQL
   until their TTL runs out: how long until the store holds none of them, and until
   the engine is back at the limit (mean over half a second >= 0.9 x limit); then
   edge-2 started again on its ports, and the same figures for ``--after-s`` more.

``--per-edge``: the edges without the shared store (each counts the key alone, as before
adapters/pg_key_slots.py), the steady phase only: what the figures look like when the
limit does not hold across edges.

    .venv/bin/python tools/hardening/limits_sustained.py [--limit 4] [--clients 16] \\
        [--hold-ms 500] [--steady-s 20] [--ttl 3] [--after-s 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: the bench package

from bench.backends import fake_backend
from bench.edges_stack import EdgesStack, start_edges, wait_served
from bench.stack import ProviderSpec

from iop_proto.testing import running_service
from iop_proto.testing_postgres import PostgresServer, why_postgres_cannot_run

RETRY_S = 0.01  # after a 429: the next try, jittered up to twice this
SAMPLE_S = 0.05  # the engine's gauge read this often, for the timeline
BACK_WINDOW_S = 0.5  # "back at the limit": the mean over this window >= 0.9 x limit


@dataclass
class Load:
    """The clients' counts, and the engine's gauge read every ``SAMPLE_S``."""

    ok: int = 0
    refused: int = 0
    errors: int = 0
    other: dict[int, int] = field(default_factory=dict)
    served_s: list[float] = field(default_factory=list)  # each 200's latency at the client
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (t, now, integral)
    held: list[tuple[float, int]] = field(default_factory=list)  # (t, slots live in the store)
    other_at: list[float] = field(default_factory=list)  # when each answer of ``other`` came
    other_bodies: list[str] = field(default_factory=list)  # the first few of them, to read
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def halt(self) -> None:
        """Stop the clients and the sampler (each ends its request first)."""
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def stats(http: aiohttp.ClientSession, engine: str, reset: bool = False) -> dict[str, Any]:
    method = http.post if reset else http.get
    async with method(f"{engine}/stats{'/reset' if reset else ''}") as response:
        result: dict[str, Any] = await response.json()
        return result


async def client(url: str, secret: str, model: str, load: Load, stop: asyncio.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hold"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {secret}"}
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection: the balancer's turn
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        while not stop.is_set():
            started = time.monotonic()
            try:
                async with http.post(url, json=body, headers=headers) as response:
                    answer = await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError):
                load.errors += 1  # the killed edge's: its connections are cut
                await asyncio.sleep(RETRY_S * 5)
                continue
            if status == 200:
                load.ok += 1
                load.served_s.append(time.monotonic() - started)
            elif status == 429:
                load.refused += 1
                await asyncio.sleep(RETRY_S * (1 + random.random()))
            else:
                load.other[status] = load.other.get(status, 0) + 1
                load.other_at.append(time.monotonic())
                if len(load.other_bodies) < 5:
                    load.other_bodies.append(f"{status}: {answer[:300].decode(errors='replace')}")
                await asyncio.sleep(RETRY_S * 5)


async def sampler(engine: str, dsn: str | None, load: Load, stop: asyncio.Event) -> None:
    """The engine's gauge and the key's live slots in the store (with ``--per-edge``,
    none), every ``SAMPLE_S``: the store's count is the limit as the edges see it,
    without the path's milliseconds."""
    connection = await asyncpg.connect(dsn) if dsn is not None else None
    try:
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                now = await stats(http, engine)
                load.samples.append((time.monotonic(), now["now"], now["integral"]))
                if connection is not None:
                    held = await connection.fetchval(
                        "SELECT count(*) FROM iop_key_slots WHERE expires_at > now()"
                    )
                    load.held.append((time.monotonic(), int(held)))
                await asyncio.sleep(SAMPLE_S)
    finally:
        if connection is not None:
            await connection.close()


def held_between(load: Load, since: float, until: float) -> dict[str, float]:
    """The most slots the store held at once in the samples, and their mean."""
    counts = [n for t, n in load.held if since <= t <= until] or [0]
    return {"store_peak": max(counts), "store_mean": sum(counts) / len(counts)}


@contextlib.asynccontextmanager
async def loaded(
    url: str, secret: str, model: str, clients: int, engine: str, dsn: str | None
) -> AsyncIterator[Load]:
    load = Load()
    stop = load.stop
    load.tasks = [
        asyncio.create_task(client(url, secret, model, load, stop)) for _ in range(clients)
    ]
    load.tasks.append(asyncio.create_task(sampler(engine, dsn, load, stop)))
    try:
        yield load
    finally:
        await load.halt()


async def window(http: aiohttp.ClientSession, engine: str, seconds: float) -> dict[str, float]:
    """The engine's peak and mean over the next ``seconds``."""
    await stats(http, engine, reset=True)
    await asyncio.sleep(seconds)
    return summary(await stats(http, engine))


def summary(end: dict[str, Any]) -> dict[str, float]:
    """Peak and mean since the engine's gauge was reset, over how many seconds."""
    return {"peak": end["peak"], "mean": end["integral"] / end["seconds"], "s": end["seconds"]}


def back_at(load: Load, since: float, until: float, limit: int) -> float:
    """Seconds after ``since`` until the engine was back at the limit for good (up to
    ``until``): the end of the last window of ``BACK_WINDOW_S`` whose mean was below
    0.9 x limit; 0 when none was (the killed edge's runs may go on at the engine a while)."""
    later = [s for s in load.samples if since <= s[0] <= until]
    back = 0.0
    for i, (t0, _, i0) in enumerate(later):
        for t1, _, i1 in later[i + 1 :]:
            if t1 - t0 >= BACK_WINDOW_S:
                if (i1 - i0) / (t1 - t0) < 0.9 * limit:
                    back = t1 - since
                break
    return back


async def edge_slots(dsn: str, edge_id: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        count: int = await connection.fetchval(
            "SELECT count(*) FROM iop_key_slots WHERE edge_id = $1 AND expires_at > now()",
            edge_id,
        )
        return count
    finally:
        await connection.close()


def pin_ports(stack: EdgesStack, name: str) -> Path:
    """Edge ``name``'s settings with the ports it bound, so a restart comes back on them."""
    path = stack.root / f"{name}.yaml"
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    ports = stack.edge_services[name].ports
    data["http"]["port"], data["node_listener"]["port"] = ports["http"], ports["nodes"]
    path.write_text(yaml.safe_dump(data))
    return path


async def churn(
    stack: EdgesStack, dsn: str, args: argparse.Namespace, secret: str, load: Load, engine: str
) -> dict[str, Any]:
    """SIGKILL edge-2 under load; until its slots are freed and the engine is back at the
    limit; then edge-2 again, and the steady figures after."""
    settings = pin_ports(stack, "edge-2")
    victim = stack.edge_services["edge-2"].process
    async with aiohttp.ClientSession() as http:
        await stats(http, engine, reset=True)  # the peak from the kill on
        held = await edge_slots(dsn, "edge-2")
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        async with asyncio.timeout(args.ttl * 3 + 10):
            while await edge_slots(dsn, "edge-2"):  # noqa: ASYNC110 - in PostgreSQL
                await asyncio.sleep(0.05)
        freed_s = time.monotonic() - killed
        await asyncio.sleep(BACK_WINDOW_S * 4)  # windows after the slots came back
        end = await stats(http, engine)
        during = {
            "peak": end["peak"],
            "mean": end["integral"] / end["seconds"],
            "s": end["seconds"],
        }
        back_s = back_at(load, killed, time.monotonic(), args.limit)
        starting = time.monotonic()
        async with running_service("iop-edge", settings, ready_timeout=60) as again:
            restarted = time.monotonic()
            await wait_served(stack.edge_urls[1], [args.model], 60, secret)
            served_s = time.monotonic() - restarted
            started = time.monotonic()
            after = await window(http, engine, args.after_s)
            after.update(held_between(load, started, time.monotonic()))
            # the load ends before the edge does: a draining edge answers 503, by design
            await load.halt()
            again.process.send_signal(signal.SIGTERM)
            await again.process.wait()
    return {
        "slots_held_by_edge_2_when_killed": held,
        "slots_freed_after_s": freed_s,
        "engine_back_at_limit_after_s": back_s,
        "from_kill_until_freed": during,
        "edge_2_serving_again_after_s": served_s,
        "after_restart": after,
        # answers other than 200 and 429 from edge-2's start until it served the model:
        # the balancer sends it requests once it listens, before its node linked again
        "other_since_kill_s": [round(t - killed, 2) for t in load.other_at if t >= killed],
        "edge_2_started_since_kill_s": starting - killed,
        "other_while_edge_2_started": sum(
            starting <= t <= restarted + served_s for t in load.other_at
        ),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    reason = why_postgres_cannot_run()
    if reason is not None:
        raise SystemExit(f"cannot run: {reason}")
    server = await asyncio.to_thread(PostgresServer.start)
    try:
        dsn = await asyncio.to_thread(server.create_database)
        with tempfile.TemporaryDirectory(prefix="iop-limits-") as scratch:
            root = Path(scratch)
            async with fake_backend(root / "fake.log", args.model) as (engine, _):
                provider = ProviderSpec(
                    "engine", "openai_api", "api", (args.model,), endpoint=engine,
                    capacity=args.clients * 2, max_queue=args.clients * 4,
                )  # fmt: skip
                async with start_edges(
                    root / "stack",
                    [provider],
                    count=2,
                    balancers={"balancer": [0, 1]},
                    postgres_dsn=None if args.per_edge else dsn,
                    edge_extra={"key_slot_ttl_s": args.ttl},
                    node_extra={"reconnect": {"initial_s": 0.1, "max_s": 0.5}},
                    keys={"limited": args.limit},
                ) as (stack, secrets):
                    return await drive(stack, dsn, args, secrets["limited"], engine)
    finally:
        await asyncio.to_thread(server.stop)


async def drive(
    stack: EdgesStack, dsn: str, args: argparse.Namespace, secret: str, engine: str
) -> dict[str, Any]:
    url = f"{stack.balancers['balancer']}/v1/chat/completions"
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    store = None if args.per_edge else dsn
    async with loaded(url, secret, args.model, args.clients, engine, store) as load:
        async with aiohttp.ClientSession() as http:
            await asyncio.sleep(1.0)  # every client in its loop
            started = time.monotonic()
            result["steady"] = await window(http, engine, args.steady_s)
            result["steady"].update(held_between(load, started, time.monotonic()))
        if args.churn and not args.per_edge:
            result["churn"] = await churn(stack, dsn, args, secret, load, engine)
    served = sorted(load.served_s) or [float("nan")]
    result["requests"] = {
        "ok": load.ok, "refused_429": load.refused, "errors": load.errors, "other": load.other,
        "served_p50_ms": served[len(served) // 2] * 1000,
        "other_bodies": load.other_bodies,
    }  # fmt: skip
    # what each slot's cycle costs beyond the engine's hold, from the steady mean: the
    # path to the engine and back, the slot's take and give-back, the next client's turn
    mean = result["steady"]["mean"]
    used = mean and not args.per_edge  # per edge, the mean is over the limit: no such cost
    result["steady"]["cycle_overhead_ms"] = args.hold_ms * (args.limit / mean - 1) if used else None
    return result


def report(result: dict[str, Any], limit: int) -> None:
    steady = result["steady"]
    cycle = steady["cycle_overhead_ms"]
    print(
        f"steady ({steady['s']:.0f} s, key limit {limit}, {result['settings']['clients']} clients"
        f" over two edges): engine peak {steady['peak']}, mean {steady['mean']:.2f}"
        f" ({steady['mean'] / limit:.0%} of the limit"
        + (
            " (edges without the shared store: each counts alone))"
            if cycle is None
            else f"; each slot's cycle costs {cycle:.0f} ms beyond the engine's"
            f" {result['settings']['hold_ms']} ms); slots held in the store: peak"
            f" {steady['store_peak']}, mean {steady['store_mean']:.2f}"
        )
    )
    if "churn" in result:
        c = result["churn"]
        back = c["engine_back_at_limit_after_s"]
        after = c["after_restart"]
        print(
            f"edge-2 SIGKILLed holding {c['slots_held_by_edge_2_when_killed']} slot(s):"
            f" freed in the store after {c['slots_freed_after_s']:.2f} s"
            f" (TTL {result['settings']['ttl']:g} s); engine back at >= 90% of the limit after"
            f" {back:.2f} s;"
            f" engine peak meanwhile {c['from_kill_until_freed']['peak']},"
            f" mean {c['from_kill_until_freed']['mean']:.2f}"
        )
        print(
            f"edge-2 started again (serving after {c['edge_2_serving_again_after_s']:.1f} s):"
            f" next {after['s']:.0f} s peak {after['peak']}, mean {after['mean']:.2f};"
            f" in the store peak {after['store_peak']}, mean {after['store_mean']:.2f};"
            f" {c['other_while_edge_2_started']} answer(s) neither 200 nor 429 while it started"
        )
    print(f"requests: {result['requests']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--hold-ms", type=int, default=500)
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--ttl", type=float, default=3.0, help="the edges' key_slot_ttl_s")
    parser.add_argument("--after-s", type=float, default=8.0)
    parser.add_argument("--no-churn", dest="churn", action="store_false")
    parser.add_argument(
        "--per-edge",
        action="store_true",
        help="edges without the shared store (each counts the key alone: the limit x 2); no churn",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    args.model = f"fake-d{args.hold_ms}"  # the fake engine's hold, by the model's name
    result = asyncio.run(measure(args))
    report(result, args.limit)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
