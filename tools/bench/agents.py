"""Agents: coding-agent sessions over three llama.cpp engines, routed by IOP and its peers.

Each target gets the same load on three fresh engines (``engines.py``: restarted per
target, so nobody inherits a warm cache), one target after the other:

- ``iop``: a real IOP stack, one node with three ``llamacpp`` providers of capacity 1
  behind one public model; the session's id in ``x-session-id``;
- ``iop_prefix``: the same without the session header (the prompt alone);
- ``iop_lowest_load``: the same with cache affinity off (``affinity.enabled: false``):
  the seed's rule alone, lowest ``in_flight / capacity``, the baseline of the same run;
- ``smg``, ``vllm_router``, ``sglang_router``: their ``cache_aware`` policy over the
  three engines (smg 1.13.0 in its generic HTTP mode); ``vllm_router_rr``: vllm-router's
  ``round_robin``, a reference with no cache awareness;
- ``oracle``: no router; session ``i`` always goes straight to engine ``i % 3``.

Per target and load: TTFT (request to first content chunk) p50/p95, wall time, the
prompt tokens the engines evaluated and served from cache (their ``/metrics``
counters, before and after), and the share of turns served by the engine of the
session's previous turn (from the answer's ``model``, each engine's own alias, which
the routers relay unchanged; IOP names its run in the answer's ``id`` and its run log
names the provider).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .agent_load import Route, Turn, Workload, attribute, run_load, same_engine_share
from .client import percentile
from .engines import EngineSet, EngineSettings, delta, engine_of, start_engines
from .procs import Gateway
from .results import Row, ScenarioResult, fmt, ratio
from .routers import SGLANG_ROUTER, SMG, VLLM_ROUTER, RouterKind, start_router
from .stack import ProviderSpec, start_iop

SCENARIO: Final = "agents"
MODEL: Final = "agents"  # IOP's public model over the three engines
PROVIDER_PREFIX: Final = "agent-p"
TARGETS: Final = (
    "iop", "iop_prefix", "iop_lowest_load", "smg", "vllm_router", "sglang_router",
    "vllm_router_rr", "oracle",
)  # fmt: skip
ROUTED: Final[dict[str, tuple[RouterKind, str]]] = {
    "smg": (SMG, "cache_aware"),
    "vllm_router": (VLLM_ROUTER, "cache_aware"),
    "sglang_router": (SGLANG_ROUTER, "cache_aware"),
    "vllm_router_rr": (VLLM_ROUTER, "round_robin"),
}
LOADS: Final = ("agent", "no_prefix")
RUN_LOG_WAIT_S: Final = 10.0


@dataclass(frozen=True)
class Settings:
    load: Workload
    loads: tuple[str, ...] = LOADS
    engines: EngineSettings = field(default_factory=EngineSettings)


def missing_targets(wanted: Sequence[str]) -> dict[str, str]:
    """Why each target that cannot run here is skipped."""
    missing = {name: "not selected (--agents-targets)" for name in TARGETS if name not in wanted}
    for name, (kind, _) in ROUTED.items():
        if name not in missing and not kind.available():
            missing[name] = kind.missing()
    return missing


async def run(root: Path, settings: Settings, wanted: Sequence[str] = TARGETS) -> ScenarioResult:
    result = ScenarioResult(SCENARIO)
    missing = missing_targets(wanted)
    measured: dict[str, dict[str, dict[str, Any]]] = {load: {} for load in settings.loads}
    restarts: list[float] = []
    for i, load in enumerate(settings.loads):
        names = [t for t in TARGETS if t not in missing]
        # each load in another order: the machine's load drifts, no target always goes first
        for name in names if i % 2 == 0 else names[::-1]:
            print(f"   agents: {load} via {name}", file=sys.stderr, flush=True)
            try:
                measured[load][name] = await _measure(
                    root / f"{load}-{name}", name, settings, load == "agent", restarts
                )
            except Exception as exc:  # one target's failure is reported, the rest still run
                traceback.print_exc()
                measured[load][name] = {"failed": f"{type(exc).__name__}: {exc}"}
    failed = {f"{load}/{n}": m["failed"] for load, ms in measured.items() for n, m in ms.items()
              if "failed" in m}  # fmt: skip
    if failed:
        result.status, result.reason = "failed", "; ".join(f"{k}: {v}" for k, v in failed.items())
    result.data = {
        "targets": measured,
        "skipped": missing,
        "engine_start_s": restarts,
        "settings": {"load": settings.load.__dict__, "loads": list(settings.loads),
                     "engines": settings.engines.__dict__},
    }  # fmt: skip
    result.data["table"] = table(measured, missing)
    result.rows = rows(measured, missing)
    return result


async def _measure(
    root: Path, name: str, settings: Settings, shared_prefix: bool, restarts: list[float]
) -> dict[str, Any]:
    shared = "agent" if name == "smg" else None
    async with start_engines(root / "engines", settings.engines, shared) as engines:
        restarts.append(engines.start_s)
        async with _target(root, name, engines) as (route, identify, gateway):
            load_average = os.getloadavg()
            before = await engines.counters()
            cpu_before = gateway.cpu() if gateway else 0.0
            turns, wall = await run_load(route, settings.load, shared_prefix)
            cpu = gateway.cpu() - cpu_before if gateway else 0.0
            after = await engines.counters()
            await identify(turns)
    summary = summarise(turns, wall, delta(after, before))
    summary["gateway_cpu_s"] = cpu
    summary["load_average_at_start"] = load_average
    return summary


Identify = Callable[[list[Turn]], Awaitable[None]]  # fills each Turn.engine


@contextlib.asynccontextmanager
async def _target(
    root: Path, name: str, engines: EngineSet
) -> AsyncIterator[tuple[Route, Identify, Gateway | None]]:
    """How to reach ``name``, how to tell which engine served each turn, and the
    gateway's processes (``None`` for the oracle, which has none)."""

    async def by_model(turns: list[Turn]) -> None:
        attribute(turns, lambda t: engine_of(t.model))

    if name == "oracle":
        urls = tuple(f"{url}/v1" for url in engines.urls)
        yield Route(urls, "agent", session_header=True), by_model, None
    elif name in ROUTED:
        kind, policy = ROUTED[name]
        extra = ("--routing-key-headers", "x-session-id") if kind is SMG else ()
        async with start_router(
            kind, root, engines.urls, "agent", policy=policy, extra=extra
        ) as router:
            if kind is SMG:
                index = {
                    url: engine.index
                    for engine, url in zip(engines.engines, engines.urls, strict=True)
                }

                async def by_worker(turns: list[Turn]) -> None:
                    attribute(turns, lambda t: index.get(t.worker.rstrip("/")))

                route = Route((router.base_url,), "agent", session_header=True)
                yield route, by_worker, router.gateway()
            else:
                route = Route((router.base_url,), "agent", session_header=True)
                yield route, by_model, router.gateway()
    else:
        providers = [
            ProviderSpec(f"{PROVIDER_PREFIX}{e.index}", "llamacpp", "local_inference",
                         (e.alias,), endpoint=e.url, capacity=1)
            for e in engines.engines
        ]  # fmt: skip
        pools = {MODEL: {p.id: p.models[0] for p in providers}}
        affinity_off = {"affinity": {"enabled": False}} if name == "iop_lowest_load" else None
        async with start_iop(root / "iop", providers, pools=pools, edge_extra=affinity_off) as iop:

            async def by_run_log(turns: list[Turn]) -> None:
                providers_of = await _run_providers(root / "iop" / "edge-runs.db", turns)
                attribute(turns, lambda t: _provider_engine(providers_of.get(t.answer_id)))

            route = Route((iop.api_url,), MODEL, session_header=name != "iop_prefix")
            yield route, by_run_log, iop.gateway()


async def _run_providers(database: Path, turns: list[Turn]) -> dict[str, str]:
    """answer id -> provider id, from the edge's run log (written in batches: waited for)."""
    wanted = {t.answer_id.removeprefix("chatcmpl-"): t.answer_id for t in turns}
    deadline = time.monotonic() + RUN_LOG_WAIT_S
    while True:
        found = await asyncio.to_thread(_read_runs, database, list(wanted))
        if len(found) == len(wanted) or time.monotonic() > deadline:
            return {wanted[run]: provider for run, provider in found.items()}
        await asyncio.sleep(0.25)


def _read_runs(database: Path, run_ids: list[str]) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        marks = ",".join("?" * len(run_ids))
        query = f"SELECT run_id, provider_id FROM runs WHERE run_id IN ({marks})"
        return dict(db.execute(query, run_ids).fetchall())


def _provider_engine(provider: str | None) -> int | None:
    if provider is None or not provider.startswith(PROVIDER_PREFIX):
        return None
    return int(provider.removeprefix(PROVIDER_PREFIX))


def summarise(turns: list[Turn], wall: float, counters: list[dict[str, float]]) -> dict[str, Any]:
    ttfts = [t.ttft_s * 1000 for t in turns]
    later = [t.ttft_s * 1000 for t in turns if t.turn > 0]
    evaluated = sum(c["prompt_tokens"] for c in counters)
    cached = sum(c["cached_tokens"] for c in counters)
    return {
        "requests": len(turns),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "ttft_p50_later_turns_ms": percentile(later, 50),
        "wall_s": wall,
        "prompt_tokens_evaluated": evaluated,
        "prompt_tokens_cached": cached,
        "cached_share": ratio(cached, evaluated + cached),
        "same_engine_share": same_engine_share(turns),
        # the engines' own prefill speed: the machine's share of the cores at the time
        "engine_prompt_tokens_per_s": ratio(evaluated, sum(c["prompt_seconds"] for c in counters)),
        "per_engine": counters,
        "turns": [t.__dict__ for t in turns],
    }


COLUMNS: Final = (
    ("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p95 ms", "ttft_p95_ms"), ("wall s", "wall_s"),
    ("prompt evaluated", "prompt_tokens_evaluated"), ("cached", "prompt_tokens_cached"),
    ("cached share", "cached_share"), ("same engine", "same_engine_share"),
    ("engine tok/s", "engine_prompt_tokens_per_s"), ("gateway CPU s", "gateway_cpu_s"),
)  # fmt: skip
RATIOS: Final = ("ttft_p50_ms", "wall_s", "prompt_tokens_evaluated")


def table(measured: dict[str, dict[str, dict[str, Any]]], missing: dict[str, str]) -> str:
    """Targets as rows, per load; the last columns divide by the oracle's figure."""
    heads = ("load", "target", *(c for c, _ in COLUMNS), *(f"{k} / oracle" for k in RATIOS))
    body: list[tuple[str, ...]] = []
    for load, targets in measured.items():
        oracle = targets.get("oracle", {})
        for name in TARGETS:
            m = targets.get(name)
            if m is None or "failed" in m:
                reason = missing.get(name) or (m or {}).get("failed", "not run")
                body.append((load, name, reason, *("",) * (len(heads) - 3)))
                continue
            cells = [fmt(m[key]) for _, key in COLUMNS]
            cells += [fmt(ratio(m[key], oracle.get(key))) for key in RATIOS]
            body.append((load, name, *cells))
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def rows(measured: dict[str, dict[str, dict[str, Any]]], missing: dict[str, str]) -> list[Row]:
    """The main table's rows: IOP (with the session header), the oracle as ``direct``,
    the two routers' ``cache_aware``; smg and the rest are in the scenario's own table."""

    def cell(targets: dict[str, dict[str, Any]], name: str, key: str) -> float | str | None:
        m = targets.get(name)
        if m is None:
            return missing.get(name, "not run")
        return "failed" if "failed" in m else m[key]

    out: list[Row] = []
    for load, targets in measured.items():
        for label, key, unit in (
            ("TTFT p50", "ttft_p50_ms", "ms"), ("TTFT p95", "ttft_p95_ms", "ms"),
            ("wall time", "wall_s", "s"),
            ("prompt tokens evaluated", "prompt_tokens_evaluated", ""),
            ("same engine as the previous turn", "same_engine_share", "share"),
        ):  # fmt: skip
            iop, oracle = cell(targets, "iop", key), cell(targets, "oracle", key)
            out.append(Row(
                SCENARIO, f"{load}: {label}", unit,
                iop if isinstance(iop, float | int) else None,
                oracle if isinstance(oracle, float | int) else None,
                "not measured", ratio(iop if isinstance(iop, float | int) else None, oracle),
                "IOP/oracle", vllm_router=cell(targets, "vllm_router", key),
                sglang_router=cell(targets, "sglang_router", key),
            ))  # fmt: skip
    return out
