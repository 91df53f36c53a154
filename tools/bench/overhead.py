"""Gateway overhead: the same non-streamed requests direct, through IOP and through each peer
(LiteLLM, vllm-router, sglang-router).

Measured the way vllm-project/router's docs/benchmarks/router_overhead.md measures
it: direct and routed requests in one run, alternating (the order rotates every
round, so neither side always goes first on a warm cache), the routed figure
minus the direct one as the gateway's cost.

- concurrency 1: p50, p99 and mean latency; "added" is the gateway's minus direct;
- concurrency 64, closed loop for a fixed time, rounds alternating: requests/s;
- CPU seconds per 1,000 requests of the gateway's processes (edge + node for IOP)
  over the concurrency-64 rounds, from /proc utime + stime;
- peak RSS (VmHWM) of the gateway's processes at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .client import Target, closed_loop, complete, rotated, session, summary_ms
from .procs import Gateway
from .results import Row, ScenarioResult, peer_cells, ratio

SCENARIO = "overhead"


@dataclass(frozen=True)
class Settings:
    warmup: int
    pairs: int  # rounds at concurrency 1 (each target once per round)
    concurrency: int
    rounds: int  # rounds at concurrency 64 (each target once per round)
    seconds: float  # per target per round


async def _latency(
    targets: dict[str, Target], settings: Settings, reported: list[float]
) -> dict[str, list[float]]:
    """Latencies at c=1 by target; IOP's own ``x-iop-overhead-ms`` values go to ``reported``."""
    names = list(targets)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    async with session(len(names)) as http:
        for name in names:
            for _ in range(settings.warmup):
                await complete(http, targets[name])
        for i in range(settings.pairs):
            for name in rotated(names, i):
                own = reported if name == "iop" else None
                latencies[name].append(await complete(http, targets[name], reported=own))
    return latencies


async def _throughput(
    targets: dict[str, Target], gateways: dict[str, Gateway], settings: Settings
) -> dict[str, dict[str, float]]:
    names = list(targets)
    totals = {name: {"done": 0.0, "failed": 0.0, "seconds": 0.0, "cpu_s": 0.0} for name in names}
    async with session(settings.concurrency * len(names)) as http:
        for name in names:  # open the connections before anything is timed
            await closed_loop(http, targets[name], settings.concurrency, 0.3)
        for i in range(settings.rounds):
            for name in rotated(names, i):
                gateway = gateways.get(name)
                cpu_before = gateway.cpu() if gateway else 0.0
                done, failed, elapsed = await closed_loop(
                    http, targets[name], settings.concurrency, settings.seconds
                )
                cpu_after = gateway.cpu() if gateway else 0.0
                total = totals[name]
                total["done"] += done
                total["failed"] += failed
                total["seconds"] += elapsed
                total["cpu_s"] += cpu_after - cpu_before
    return totals


async def run(
    targets: dict[str, Target],
    gateways: dict[str, Gateway],
    settings: Settings,
    missing: dict[str, str],
) -> ScenarioResult:
    """``targets`` has ``direct`` and ``iop``, and each peer (``results.PEERS``) not in
    ``missing``, which says why that peer is not measured (in its column)."""
    result = ScenarioResult(SCENARIO)
    reported: list[float] = []
    latencies = await _latency(targets, settings, reported)
    stats = {name: summary_ms(values) for name, values in latencies.items()}
    header = summary_ms([ms / 1000 for ms in reported])
    totals = await _throughput(targets, gateways, settings)
    rps = {
        name: t["done"] / t["seconds"] if t["seconds"] else float("nan")
        for name, t in totals.items()
    }
    cpu_per_1000 = {
        name: totals[name]["cpu_s"] / totals[name]["done"] * 1000
        for name in gateways
        if totals.get(name, {}).get("done")
    }
    rss = {name: gateway.peak_rss() for name, gateway in gateways.items()}
    result.data = {
        "latency_ms": stats,
        "x_iop_overhead_ms": header,
        "throughput": {name: {**totals[name], "rps": rps[name]} for name in totals},
        "cpu_s_per_1000": cpu_per_1000,
        "peak_rss_mib": rss,
        "settings": settings.__dict__,
    }
    failed = sum(int(t["failed"]) for t in totals.values())
    if failed:
        result.status = "failed"
        result.reason = f"{failed} requests failed at concurrency {settings.concurrency}"

    direct = stats["direct"]

    def added(name: str, key: str) -> float | None:
        return stats[name][key] - direct[key] if name in stats else None

    def cells(value: Callable[[str], float | None]) -> dict[str, float | str | None]:
        return peer_cells(value, missing)

    def of(table: Mapping[str, float], name: str) -> float | None:
        return table.get(name)

    iop_mean = added("iop", "mean")
    lite_mean = added("litellm", "mean")
    vllm_p50 = added("vllm_router", "p50")
    c = settings.concurrency
    iop_rps = rps["iop"]
    rows = [
        Row(SCENARIO, "latency p50 at c=1", "ms", stats["iop"]["p50"], direct["p50"],
            **cells(lambda n: stats[n]["p50"])),
        Row(SCENARIO, "latency p99 at c=1", "ms", stats["iop"]["p99"], direct["p99"],
            **cells(lambda n: stats[n]["p99"])),
        Row(SCENARIO, "added p50 at c=1", "ms", added("iop", "p50"), 0.0,
            **cells(lambda n: added(n, "p50")), target="IOP <= 1.0 ms",
            met=_met(added("iop", "p50"), lambda v: v <= 1.0)),
        Row(SCENARIO, "x-iop-overhead-ms p50 at c=1 (IOP's own header)", "ms", header["p50"],
            None, **cells(lambda n: None)),
        Row(SCENARIO, "added p50 at c=1 vs vllm-router", "ms", added("iop", "p50"), None,
            **cells(lambda n: added(n, "p50")), ratio=ratio(added("iop", "p50"), vllm_p50),
            ratio_of="IOP/vllm-router", target="<= 2x vllm-router",
            met=_met(ratio(added("iop", "p50"), vllm_p50), lambda r: r <= 2.0)),
        Row(SCENARIO, "added p99 at c=1", "ms", added("iop", "p99"), 0.0,
            **cells(lambda n: added(n, "p99")), target="IOP <= 3 ms",
            met=_met(added("iop", "p99"), lambda v: v <= 3.0)),
        Row(SCENARIO, "added mean at c=1 (mean minus direct)", "ms", iop_mean, 0.0,
            **cells(lambda n: added(n, "mean")), ratio=ratio(iop_mean, lite_mean),
            ratio_of="IOP/LiteLLM", target="IOP <= 1/5 of LiteLLM",
            met=_met(ratio(iop_mean, lite_mean), lambda r: r <= 0.2)),
        Row(SCENARIO, f"throughput at c={c}", "req/s", iop_rps, rps["direct"],
            **cells(lambda n: of(rps, n)), ratio=ratio(iop_rps, rps["direct"]),
            ratio_of="IOP/direct", target=">= 0.5x direct",
            met=_met(ratio(iop_rps, rps["direct"]), lambda r: r >= 0.5)),
        Row(SCENARIO, f"throughput at c={c} vs LiteLLM (1 worker each)", "req/s", iop_rps, None,
            **cells(lambda n: of(rps, n)), ratio=ratio(iop_rps, rps.get("litellm")),
            ratio_of="IOP/LiteLLM", target=">= 5x LiteLLM",
            met=_met(ratio(iop_rps, rps.get("litellm")), lambda r: r >= 5)),
        Row(SCENARIO, f"CPU per 1,000 requests at c={c}", "s", cpu_per_1000.get("iop"), None,
            **cells(lambda n: of(cpu_per_1000, n)),
            ratio=ratio(cpu_per_1000.get("litellm"), cpu_per_1000.get("iop")),
            ratio_of="LiteLLM/IOP"),
        Row(SCENARIO, "peak RSS of the gateway processes", "MiB", rss["iop"]["total"], None,
            **cells(lambda n: rss[n]["total"] if n in rss else None)),
    ]  # fmt: skip
    result.rows = rows
    return result


def _met(value: float | None, check: Callable[[float], bool]) -> bool | None:
    return None if value is None else check(value)
