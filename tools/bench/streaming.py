"""Streaming through a gateway: time to first token, chunks/s, and no buffering.

- added TTFT: short streams alternating direct / IOP / each peer; p50 minus direct;
- chunks/s through one edge: concurrent 1,000-chunk streams the fake sends as fast
  as the socket takes them, back to back for a fixed time; content chunks received
  per second by the client;
- the largest inter-chunk gap added: streams paced by the fake (e.g. one chunk
  every 5 ms); a gateway that buffers, or stalls on its own work, shows a longer
  gap than the direct stream's. Its largest gap minus direct's largest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from .client import RequestFailed, Target, percentile, rotated, session, stream, summary_ms
from .results import Row, ScenarioResult, peer_cells, ratio

SCENARIO = "streaming"
TTFT_TOKENS = 4


@dataclass(frozen=True)
class Settings:
    ttft_pairs: int
    chunks: int  # per stream in the throughput run (the 1,000)
    concurrency: int  # streams at once in the throughput run
    seconds: float  # per target per round
    rounds: int
    gap_streams: int  # paced streams per target
    gap_chunks: int
    gap_rate: int  # chunks/s the fake paces them at


async def _ttft(targets: dict[str, Target], settings: Settings) -> dict[str, list[float]]:
    names = list(targets)
    out: dict[str, list[float]] = {name: [] for name in names}
    async with session(len(names)) as http:
        for name in names:  # warm the connections
            await stream(http, targets[name], TTFT_TOKENS)
        for i in range(settings.ttft_pairs):
            for name in rotated(names, i):
                timing = await stream(http, targets[name], TTFT_TOKENS)
                out[name].append(timing.ttft_s)
    return out


async def _streams_for(
    http: aiohttp.ClientSession, target: Target, settings: Settings
) -> tuple[int, int, float]:
    """``concurrency`` workers streaming back to back for ``seconds``: (chunks, failed, s)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    end = started + settings.seconds
    chunks = failed = 0

    async def worker() -> None:
        nonlocal chunks, failed
        while loop.time() < end:
            try:
                await stream(http, target, settings.chunks, timed=False)
            except (RequestFailed, aiohttp.ClientError, TimeoutError):
                failed += 1
            else:
                chunks += settings.chunks

    async with asyncio.TaskGroup() as group:
        for _ in range(settings.concurrency):
            group.create_task(worker())
    return chunks, failed, loop.time() - started


async def _chunk_rate(
    targets: dict[str, Target], settings: Settings
) -> dict[str, dict[str, float]]:
    names = list(targets)
    totals = {name: {"chunks": 0.0, "seconds": 0.0, "failed": 0.0} for name in names}
    async with session(settings.concurrency * len(names)) as http:
        for i in range(settings.rounds):
            for name in rotated(names, i):
                chunks, failed, elapsed = await _streams_for(http, targets[name], settings)
                totals[name]["chunks"] += chunks
                totals[name]["failed"] += failed
                totals[name]["seconds"] += elapsed
    return totals


async def _gaps(targets: dict[str, Target], settings: Settings) -> dict[str, dict[str, float]]:
    names = list(targets)
    paced = {
        name: dataclasses.replace(t, model=f"{t.model}-r{settings.gap_rate}")
        for name, t in targets.items()
    }
    gaps: dict[str, list[float]] = {name: [] for name in names}
    largest: dict[str, float] = dict.fromkeys(names, 0.0)
    ttft: dict[str, list[float]] = {name: [] for name in names}
    async with session(len(names)) as http:
        for i in range(settings.gap_streams):
            for name in rotated(names, i):
                timing = await stream(http, paced[name], settings.gap_chunks)
                arrivals = timing.arrivals
                gaps[name] += [b - a for a, b in itertools.pairwise(arrivals)]
                largest[name] = max(largest[name], timing.max_gap_s)
                ttft[name].append(timing.ttft_s)
    return {
        name: {
            "max_gap_ms": largest[name] * 1000,
            "p99_gap_ms": percentile(gaps[name], 99) * 1000,
            "p50_gap_ms": percentile(gaps[name], 50) * 1000,
            "ttft_p50_ms": percentile(ttft[name], 50) * 1000,
        }
        for name in names
    }


async def run(
    targets: dict[str, Target], settings: Settings, missing: dict[str, str]
) -> ScenarioResult:
    """``targets``: ``direct``, ``iop`` and each peer not in ``missing`` (why not, by peer)."""
    result = ScenarioResult(SCENARIO)
    ttft = {name: summary_ms(values) for name, values in (await _ttft(targets, settings)).items()}
    rates = await _chunk_rate(targets, settings)
    cps = {
        name: t["chunks"] / t["seconds"] if t["seconds"] else float("nan")
        for name, t in rates.items()
    }
    gaps = await _gaps(targets, settings)
    result.data = {
        "ttft_ms": ttft,
        "chunk_rate": {name: {**rates[name], "chunks_per_s": cps[name]} for name in rates},
        "paced": gaps,
        "settings": settings.__dict__,
    }
    failed = sum(int(t["failed"]) for t in rates.values())
    if failed:
        result.status = "failed"
        result.reason = f"{failed} streams failed"

    def cells(value: Callable[[str], float]) -> dict[str, float | str | None]:
        return peer_cells(value, missing)

    direct_ttft = ttft["direct"]["p50"]
    added_ttft = ttft["iop"]["p50"] - direct_ttft
    direct_gap = gaps["direct"]["max_gap_ms"]
    added_gap = gaps["iop"]["max_gap_ms"] - direct_gap
    every = 1000 / settings.gap_rate
    result.rows = [
        Row(SCENARIO, "TTFT p50", "ms", ttft["iop"]["p50"], direct_ttft,
            **cells(lambda n: ttft[n]["p50"])),
        Row(SCENARIO, "added TTFT p50", "ms", added_ttft, 0.0,
            **cells(lambda n: ttft[n]["p50"] - direct_ttft),
            target="IOP <= 1.5 ms", met=added_ttft <= 1.5),
        Row(SCENARIO, f"chunks/s, {settings.concurrency} streams of {settings.chunks} chunks",
            "chunks/s", cps["iop"], cps["direct"], **cells(lambda n: cps[n]),
            ratio=ratio(cps["iop"], cps["direct"]), ratio_of="IOP/direct",
            target=">= 20,000 chunks/s (IOP)", met=cps["iop"] >= 20_000),
        Row(SCENARIO, f"largest inter-chunk gap, 1 chunk/{every:g} ms", "ms",
            gaps["iop"]["max_gap_ms"], direct_gap, **cells(lambda n: gaps[n]["max_gap_ms"])),
        Row(SCENARIO, "largest inter-chunk gap added", "ms", added_gap, 0.0,
            **cells(lambda n: gaps[n]["max_gap_ms"] - direct_gap),
            target="IOP <= 5 ms", met=added_gap <= 5.0),
    ]  # fmt: skip
    return result
