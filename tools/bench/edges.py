"""Edges: the pool's throughput through one edge and through two, and what each process costs.

One node (``openai_api``, the overhead scenario's fake backend behind it) linked to two
edges; the same closed loops of non-streamed completions, rounds alternating, through:

- ``1 edge``: the first edge's HTTP port;
- ``1 edge + balancer``: ``tools/tcp_balancer.py`` in front of the first edge alone, so
  the balancer's own cost is a figure of its own, not hidden in the two-edge one;
- ``2 edges + balancer``: a second balancer over both edges (round robin per connection);
- ``2 edges, client spreads``: the client's workers alternate between the two edges.

At each concurrency (16 and 64 in the quick run): requests/s, latency p50, and CPU seconds
per 1,000 completed requests of each process (``utime + stime`` from /proc: the edges,
the node, each balancer, the control-plane, the fake engine and the client itself).

With PostgreSQL installed (``iop_proto.testing_postgres``), a second stack runs the same
through edges on one PostgreSQL (the run log there) with two keys, one without a limit
and one with ``max_concurrent`` (so every request also takes and gives back a key slot):
the server's own CPU per 1,000 requests for each, which is PostgreSQL's part of the model.

Then the model of docs/ARCHITECTURE.md#how-the-edge-tier-scales, fed with the one-edge
figures, predicts the others; the prediction is reported beside the measurement.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from iop_proto.testing_postgres import PostgresServer, why_postgres_cannot_run

from .backends import fake_backend
from .client import RequestFailed, Target, complete, percentile, rotated, session
from .edges_stack import EdgesStack, start_edges
from .procs import TICKS_PER_S, cpu_seconds, descendants
from .results import Row, ScenarioResult
from .stack import ProviderSpec

SCENARIO = "edges"
MACHINE = "machine"  # in a sample: the whole machine's busy CPU seconds, not a process
MODEL = "fake"
ONE, ONE_LB, TWO_LB, TWO_SPREAD = (
    "1 edge",
    "1 edge + balancer",
    "2 edges + balancer",
    "2 edges, client spreads",
)


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...]
    seconds: float  # per target per round per level
    rounds: int
    postgres: bool  # also the stack on PostgreSQL, where it can run


@dataclass
class Measured:
    done: int = 0
    failed: int = 0
    seconds: float = 0.0
    latencies: list[float] | None = None
    cpu: dict[str, float] | None = None  # process name -> CPU seconds over the rounds

    def add_cpu(self, spent: Mapping[str, float]) -> None:
        self.cpu = self.cpu or {}
        for name, seconds in spent.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def as_json(self) -> dict[str, Any]:
        lat = [s * 1000 for s in self.latencies or []]
        cpu = dict(self.cpu or {})
        machine = cpu.pop(MACHINE, 0.0)
        per_1000 = {n: s / self.done * 1000 for n, s in cpu.items() if self.done}
        seconds = self.seconds or float("nan")
        return {
            "done": self.done,
            "failed": self.failed,
            "rps": self.done / seconds,
            "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99),
            "cpu_s_per_1000": per_1000,
            # cores this benchmark's processes kept busy, and the whole machine's: the
            # difference is what the others on the machine took meanwhile
            "cores_used": sum(cpu.values()) / seconds,
            "machine_cores_busy": machine / seconds,
        }


class Processes:
    """CPU seconds of each named process tree so far, the client's own, and the whole
    machine's (``machine``, every process's: the others sharing the cores show there)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)

    def sample(self) -> dict[str, float]:
        spent = {name: cpu_seconds(descendants(pid)) for name, pid in self._pids.items()}
        spent["client"] = time.process_time()
        spent[MACHINE] = machine_busy_s()
        return spent


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent not idle, so far (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / TICKS_PER_S


async def _loop(
    http: aiohttp.ClientSession, targets: Sequence[Target], concurrency: int, seconds: float
) -> tuple[int, int, float, list[float]]:
    """``concurrency`` closed-loop workers, worker ``i`` on ``targets[i % len]``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    end = started + seconds
    done = failed = 0
    latencies: list[float] = []

    async def worker(target: Target) -> None:
        nonlocal done, failed
        while loop.time() < end:
            try:
                latencies.append(await complete(http, target))
                done += 1
            except (RequestFailed, aiohttp.ClientError, TimeoutError):
                failed += 1

    async with asyncio.TaskGroup() as group:
        for i in range(concurrency):
            group.create_task(worker(targets[i % len(targets)]))
    return done, failed, loop.time() - started, latencies


async def measure(
    ways: Mapping[str, Sequence[Target]],
    processes: Processes,
    levels: Sequence[int],
    seconds: float,
    rounds: int,
) -> dict[int, dict[str, Measured]]:
    """Every way at every level, ``rounds`` rounds alternating; level -> way -> figures."""
    names = list(ways)
    out: dict[int, dict[str, Measured]] = {}
    for level in levels:
        out[level] = {name: Measured(latencies=[]) for name in names}
        async with session(level * len(names)) as http:
            for name in names:  # connections open and warm before anything is timed
                await _loop(http, ways[name], level, min(0.3, seconds))
            for i in range(rounds):
                for name in rotated(names, i):
                    before = processes.sample()
                    done, failed, elapsed, lat = await _loop(http, ways[name], level, seconds)
                    after = processes.sample()
                    figures = out[level][name]
                    figures.done += done
                    figures.failed += failed
                    figures.seconds += elapsed
                    assert figures.latencies is not None
                    figures.latencies.extend(lat)
                    figures.add_cpu({k: after[k] - before[k] for k in after})
    return out


def _ways(stack: EdgesStack, key: str = "sk-bench") -> dict[str, list[Target]]:
    e1, e2 = (Target(f"edge-{i}", f"{u}/v1", MODEL, key) for i, u in enumerate(stack.edge_urls))
    return {
        ONE: [e1],
        ONE_LB: [Target("balancer-1", f"{stack.balancers['balancer-1']}/v1", MODEL, key)],
        TWO_LB: [Target("balancer-2", f"{stack.balancers['balancer-2']}/v1", MODEL, key)],
        TWO_SPREAD: [e1, e2],
    }


async def on_sqlite(root: Path, fake_url: str, fake_pid: int, settings: Settings) -> dict[str, Any]:
    providers = [ProviderSpec("bench-fake", "openai_api", "api", (MODEL,), endpoint=fake_url)]
    balancers = {"balancer-1": [0], "balancer-2": [0, 1]}
    async with start_edges(root, providers, count=2, balancers=balancers) as (stack, _):
        processes = Processes({**stack.pids, "fake": fake_pid})
        figures = await measure(
            _ways(stack), processes, settings.levels, settings.seconds, settings.rounds
        )
    return {str(n): {w: m.as_json() for w, m in ways.items()} for n, ways in figures.items()}


async def on_postgres(
    root: Path, fake_url: str, fake_pid: int, settings: Settings
) -> dict[str, Any]:
    """One edge and two (the client spreading) on PostgreSQL, at the highest level: a key
    without a limit (the run log in PostgreSQL) and one with a limit (a key slot too)."""
    server = await asyncio.to_thread(PostgresServer.start)
    try:
        dsn = await asyncio.to_thread(server.create_database)
        postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        providers = [ProviderSpec("bench-fake", "openai_api", "api", (MODEL,), endpoint=fake_url)]
        keys = {"open": 0, "limited": 1_000_000}
        async with start_edges(root, providers, count=2, postgres_dsn=dsn, keys=keys) as (
            stack,
            secrets,
        ):
            processes = Processes({**stack.pids, "fake": fake_pid, "postgres": postmaster})
            ways: dict[str, list[Target]] = {}
            for name, secret in secrets.items():
                e1, e2 = (Target(f"e{i}", f"{u}/v1", MODEL, secret) for i, u in
                          enumerate(stack.edge_urls))  # fmt: skip
                ways[f"{ONE}, key {name}"] = [e1]
                ways[f"{TWO_SPREAD}, key {name}"] = [e1, e2]
            level = max(settings.levels)
            figures = await measure(ways, processes, [level], settings.seconds, settings.rounds)
    finally:
        await asyncio.to_thread(server.stop)
    return {str(level): {w: m.as_json() for w, m in figures[level].items()}}


# ---------------------------------------------------------------- the model


def per_request_ms(row: Mapping[str, Any], name: str) -> float:
    """CPU milliseconds per request of process ``name`` (0 when it did not run)."""
    return float(row["cpu_s_per_1000"].get(name, 0.0))


def predict(costs: Mapping[str, float], edges: int, cores: float, balanced: bool) -> float | None:
    """Requests/s the model predicts: each process is one event loop (at most one core),
    and all of them share ``cores``. ``costs``: CPU ms per request of one edge, the node,
    the balancer, the engine, the client and PostgreSQL, each measured through one edge.

    A cost of 0 is a process whose CPU stayed under the clock's tick over a short round
    (the fake engine, a tiny run's client): it bounds nothing, so it gives no cap. None
    when no process's CPU was measured at all: then the model has nothing to say.
    """
    balancer = costs["balancer"] if balanced else 0.0
    loops = {"edge": edges, "node": 1, "engine": 1, "client": 1}
    if balanced:
        loops["balancer"] = 1
    caps = [n * 1000 / costs[name] for name, n in loops.items() if costs[name] > 0]
    shared = sum(costs[name] for name in ("edge", "node", "engine", "client"))
    shared += balancer + costs.get("postgres", 0.0)
    if shared > 0:
        caps.append(cores * 1000 / shared)
    return min(caps) if caps else None


def _rps(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def model(sqlite: Mapping[str, Any], cores: int) -> dict[str, Any]:
    """The model fed with the one-edge figures (and the balancer's from its own way) at each
    level; its prediction for every way beside what was measured."""
    out: dict[str, Any] = {}
    for level, ways in sqlite.items():
        one, lb = ways[ONE], ways[ONE_LB]
        costs = {
            "edge": per_request_ms(one, "edge-1"),
            "node": per_request_ms(one, "node"),
            "balancer": per_request_ms(lb, "balancer-1"),
            "engine": per_request_ms(one, "fake"),
            "client": per_request_ms(one, "client"),
        }
        shape = {ONE: (1, False), ONE_LB: (1, True), TWO_LB: (2, True), TWO_SPREAD: (2, False)}
        out[level] = {
            "cost_ms_per_request": costs,
            "cores": cores,
            # on idle cores: what this machine would do alone
            "predicted_rps_free": {
                way: predict(costs, n, cores, balanced=lb) for way, (n, lb) in shape.items()
            },
            # with the cores each way really got (the machine is shared): the test of the
            # per-request costs, which the model says do not grow with the edges' count
            "predicted_rps": {
                way: predict(costs, n, ways[way]["cores_used"], balanced=lb)
                for way, (n, lb) in shape.items()
            },
            "measured_rps": {way: ways[way]["rps"] for way in shape},
        }
    return out


# ---------------------------------------------------------------- the scenario


async def run(root: Path, settings: Settings) -> ScenarioResult:
    result = ScenarioResult(SCENARIO)
    data: dict[str, Any] = {"settings": settings.__dict__}
    for part in ("sqlite", "pg"):
        (root / part).mkdir(parents=True, exist_ok=True)
    async with fake_backend(root / "fake.log", MODEL) as (fake_url, fake_pid):
        data["sqlite"] = await on_sqlite(root / "sqlite", fake_url, fake_pid, settings)
        reason = why_postgres_cannot_run()
        if not settings.postgres:
            data["postgres"] = "not run in this mode"
        elif reason is not None:
            data["postgres"] = f"skipped: {reason}"
        else:
            data["postgres"] = await on_postgres(root / "pg", fake_url, fake_pid, settings)
    cores = os.cpu_count() or 1
    data["model"] = model(data["sqlite"], cores)
    result.data = data
    failed = sum(
        row["failed"]
        for part in (data["sqlite"], data["postgres"])
        if isinstance(part, dict)
        for ways in part.values()
        for row in ways.values()
    )
    if failed:
        result.status, result.reason = "failed", f"{failed} requests failed"
    result.rows = _rows(data)
    result.data["table"] = _table(data)
    return result


def _rows(data: Mapping[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for level, ways in data["sqlite"].items():
        one = ways[ONE]["rps"]
        predicted = data["model"][level]["predicted_rps"]
        for way in (ONE, TWO_LB, TWO_SPREAD):
            value = ways[way]["rps"]
            metric = f"throughput at c={level}, {way} (model: {_rps(predicted[way])})"
            ratio = value / one if one else None
            of = f"{way}/1 edge"
            rows.append(Row(SCENARIO, metric, "req/s", value, ratio=ratio, ratio_of=of))
        balancer = ways[ONE_LB]["cpu_s_per_1000"].get("balancer-1")
        rows.append(Row(SCENARIO, f"balancer's CPU per 1,000 requests at c={level}", "s", balancer))
    return rows


def _table(data: Mapping[str, Any]) -> str:
    """Every way at every level: rps, p50, CPU per 1,000 requests of each process, the
    cores it kept busy and the machine's."""
    lines = []
    for part in ("sqlite", "postgres"):
        figures = data[part]
        if not isinstance(figures, dict):
            lines.append(f"{part}: {figures}")
            continue
        for level, ways in figures.items():
            for way, row in ways.items():
                cpu = ", ".join(
                    f"{name} {seconds:.2f}"
                    for name, seconds in sorted(row["cpu_s_per_1000"].items())
                    if seconds >= 0.005
                )
                lines.append(
                    f"{part:8} c={level:<3} {way:36} {row['rps']:7.0f} req/s"
                    f"  p50 {row['p50_ms']:6.1f} ms  cores {row['cores_used']:.2f}"
                    f" (machine {row['machine_cores_busy']:.2f})  CPU s/1000: {cpu}"
                )
    for level, fit in data["model"].items():
        pairs = ", ".join(
            f"{way} {_rps(fit['predicted_rps'][way])} vs {fit['measured_rps'][way]:.0f}"
            for way in fit["predicted_rps"]
        )
        lines.append(f"model c={level} (predicted at the cores got vs measured req/s): {pairs}")
        free = ", ".join(f"{way} {_rps(rps)}" for way, rps in fit["predicted_rps_free"].items())
        lines.append(f"model c={level} on {fit['cores']} idle cores: {free}")
    return "\n".join(lines)
