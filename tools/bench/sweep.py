"""A concurrency sweep: where each gateway bends, the way BerriAI's ai-gateway-bench reports
gateways.

At each concurrency (1, 16, 64, 256 in the quick and full runs), every target runs a
closed loop of non-streamed chat completions for a fixed time, the targets one after
the other and the order rotating with each level (as everywhere in the benchmark).
Per level and target: latency p50 / p99 of the completed requests, "added" p50 / p99
(the gateway's minus direct's at the same level) and completed requests per second.
The client is the same for every column, so at 256 it is part of every figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .client import Target, closed_loop, rotated, session, summary_ms
from .results import Row, ScenarioResult, peer_cells, ratio

SCENARIO = "sweep"


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...]
    seconds: float  # per target per level


async def _level(
    targets: dict[str, Target], concurrency: int, seconds: float, i: int
) -> dict[str, dict[str, float]]:
    names = list(targets)
    out: dict[str, dict[str, float]] = {}
    async with session(concurrency * len(names)) as http:
        for name in names:  # open the connections before anything is timed
            await closed_loop(http, targets[name], concurrency, 0.1)
        for name in rotated(names, i):
            latencies: list[float] = []
            done, failed, elapsed = await closed_loop(
                http, targets[name], concurrency, seconds, latencies
            )
            stats = summary_ms(latencies)
            out[name] = {
                "p50": stats["p50"],
                "p99": stats["p99"],
                "rps": done / elapsed if elapsed else float("nan"),
                "done": done,
                "failed": failed,
                "seconds": elapsed,
            }
    return out


async def run(
    targets: dict[str, Target], settings: Settings, missing: dict[str, str]
) -> ScenarioResult:
    """``targets``: ``direct``, ``iop`` and each peer not in ``missing`` (why not, by peer)."""
    result = ScenarioResult(SCENARIO)
    levels = {
        c: await _level(targets, c, settings.seconds, i) for i, c in enumerate(settings.levels)
    }
    result.data = {"levels": levels, "settings": settings.__dict__}
    failed = sum(int(t["failed"]) for level in levels.values() for t in level.values())
    if failed:
        result.status = "failed"
        result.reason = f"{failed} requests failed in the sweep"

    rows: list[Row] = []
    for c, level in levels.items():
        direct = level["direct"]

        def cells(value: Callable[[str], float]) -> dict[str, float | str | None]:
            return peer_cells(value, missing)

        def added(name: str, key: str, level: dict[str, dict[str, float]] = level) -> float:
            return level[name][key] - level["direct"][key]

        rows += [
            Row(SCENARIO, f"added p50 at c={c}", "ms", added("iop", "p50"), 0.0,
                **cells(lambda n: added(n, "p50"))),
            Row(SCENARIO, f"added p99 at c={c}", "ms", added("iop", "p99"), 0.0,
                **cells(lambda n: added(n, "p99"))),
            Row(SCENARIO, f"throughput at c={c}", "req/s", level["iop"]["rps"], direct["rps"],
                **cells(lambda n, level=level: level[n]["rps"]),
                ratio=ratio(level["iop"]["rps"], direct["rps"]), ratio_of="IOP/direct"),
        ]  # fmt: skip
    result.rows = rows
    return result
