"""A real vLLM: tokens/s direct and through IOP, and a pool of llama.cpp and vLLM under load.

Two measurements on the same SmolLM2-135M, both engines on the same 2 cores:

- **vLLM direct vs through IOP**: the real-model scenario's method (``realmodel.pairs``:
  one stream at a time, alternating direct / IOP, ``ignore_eos`` so every stream
  generates exactly ``tokens``; the share is the median of the pairs' ratios).
- **The pool**: one public model served by llama.cpp (capacity 1) and vLLM (capacity 4),
  each under its own served name, loaded by ``pool_streams`` clients that each send
  stream after stream for ``pool_seconds`` (a closed loop: a fast member is given more
  requests, as the edge's lowest-load-ratio choice intends, instead of waiting for the
  slow one at the end of a round); all completion tokens / the elapsed time, beside the
  sum of its members' own closed loops, each direct at its capacity (llama.cpp 1 client,
  vLLM 4). On one machine the members share the cores, so the sum is a ceiling.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from . import realmodel
from .client import Target, session, stream
from .results import Row, ScenarioResult

SCENARIO = "vllm"
POOL_MODEL = "smollm2-pool"


@dataclass(frozen=True)
class Settings:
    rounds: int  # direct/IOP pairs of single streams
    tokens: int  # tokens per stream
    pool_seconds: float  # how long each closed loop runs
    pool_streams: int  # concurrent clients on the pool: the sum of its members' capacities


@dataclass(frozen=True)
class Member:
    """One provider of the pool, reached directly, and the streams it takes at once."""

    target: Target
    capacity: int


def skipped(reason: str) -> ScenarioResult:
    return ScenarioResult(SCENARIO, status="skipped", reason=reason)


async def closed_loop(target: Target, clients: int, seconds: float, tokens: int) -> float:
    """Tokens/s of ``clients`` each streaming back to back for ``seconds`` (a stream begun
    before the end is finished and counted: elapsed runs a little past ``seconds``)."""
    total = 0
    async with session(clients, keepalive=False) as http:
        await stream(http, target, 4, marker=realmodel.CONTENT, expect=1, **realmodel.EXTRA)
        started = time.perf_counter()
        end = started + seconds

        async def client() -> None:
            nonlocal total
            while time.perf_counter() < end:
                timing = await stream(
                    http, target, tokens, marker=realmodel.CONTENT, expect=1, **realmodel.EXTRA
                )
                total += timing.usage_tokens or timing.content_chunks

        async with asyncio.TaskGroup() as group:
            for _ in range(clients):
                group.create_task(client())
        return total / (time.perf_counter() - started)


async def run(
    vllm: dict[str, Target], pool: Target, members: dict[str, Member], settings: Settings
) -> ScenarioResult:
    """``vllm``: ``direct`` (the vLLM server) and ``iop``; ``pool``: the pool's public model
    through IOP; ``members``: each provider of the pool reached directly."""
    result = ScenarioResult(SCENARIO)
    single = realmodel.Settings(rounds=settings.rounds, tokens=settings.tokens)
    rates, decode = await realmodel.pairs(vllm, single)
    data, share = realmodel.summarise(rates, decode, settings)
    member_rates = {
        name: await closed_loop(m.target, m.capacity, settings.pool_seconds, settings.tokens)
        for name, m in members.items()
    }
    pool_mean = await closed_loop(
        pool, settings.pool_streams, settings.pool_seconds, settings.tokens
    )
    sum_of_members = sum(member_rates.values())
    pool_share = pool_mean / sum_of_members if sum_of_members else None
    data["pool"] = {
        "clients": settings.pool_streams,
        "seconds": settings.pool_seconds,
        "tokens_per_s": pool_mean,
        "members_tokens_per_s": member_rates,
        "members_capacity": {name: m.capacity for name, m in members.items()},
        "sum_of_members_tokens_per_s": sum_of_members,
        "pool_over_sum": pool_share,
    }
    result.data = data
    mean: dict[str, Any] = data["mean_tokens_per_s"]
    result.rows = [
        Row(SCENARIO, f"vLLM SmolLM2-135M tokens/s ({settings.tokens}-token streams)", "tokens/s",
            mean["iop"], mean["direct"], "not measured (no LiteLLM route)", share,
            "IOP/direct (median of pairs)", ">= 0.97x direct",
            None if share is None else share >= 0.97),
        Row(SCENARIO, f"pool llama.cpp+vLLM tokens/s ({settings.pool_streams} clients)",
            "tokens/s", pool_mean, sum_of_members, "not measured (no LiteLLM route)",
            pool_share, "pool via IOP / sum of members direct", "report only", None),
    ]  # fmt: skip
    return result
