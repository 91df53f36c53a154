"""Run the IOP benchmarks (overhead, sweep, streaming, floor, scale, edges, real models, agents).

    tools/bench/run.py --quick  --out var/bench/results.json   # make bench (~6 min + agents)
    tools/bench/run.py --full   --out ...                      # make bench-full
    tools/bench/run.py --tiny   --out ...                      # CI smoke: seconds, no LiteLLM

Everything runs on this machine: a fake OpenAI backend, IOP (control-plane, edge,
one node with the ``openai_api`` adapter) and, when ``make bench-peers`` installed
it, LiteLLM's proxy, all as child processes on 127.0.0.1, stopped at the end.
Every loop is bounded in count and time. Exit status 1 when a scenario failed
(an error, not a missed target: targets are reported, never enforced).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script (``tools/bench/run.py``): tools/ holds the ``bench`` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import agents, edges, floor, overhead, realmodel, scale, streaming, sweep, vllm_pool
from bench.agent_load import Workload
from bench.backends import (
    SMOLLM2,
    SMOLLM2_VLLM,
    fake_backend,
    llamacpp,
    llamacpp_missing,
    vllm,
    vllm_missing,
)
from bench.client import Target
from bench.peers import SKIPPED, litellm_available, litellm_version, start_litellm
from bench.procs import Gateway
from bench.results import PEERS, Row, ScenarioResult, render
from bench.routers import ROUTERS, SMG, start_router
from bench.stack import ProviderSpec, start_iop

SCENARIOS = (
    "overhead", "sweep", "streaming", "floor", "scale", "edges", "realmodel", "vllm", "agents",
)  # fmt: skip
GATEWAY_SCENARIOS = ("overhead", "sweep", "streaming", "realmodel", "vllm")
PEER_SCENARIOS = ("overhead", "sweep", "streaming")  # the ones with a column per peer
FAKE_MODEL = "fake"


@dataclass(frozen=True)
class Profile:
    """How much of everything one mode runs."""

    name: str
    overhead: overhead.Settings
    sweep: sweep.Settings
    streaming: streaming.Settings
    floor: floor.Settings
    scale: scale.Settings
    edges: edges.Settings
    realmodel: realmodel.Settings
    vllm: vllm_pool.Settings | None  # None: not run in this mode (vLLM takes a minute to start)
    agents: agents.Settings | None  # None: not run in this mode (minutes of real prefill)
    litellm: bool  # start LiteLLM when it is installed
    routers: bool  # start vllm-router and sglang-router when installed
    run_timeout_s: float


PROFILES = {
    "tiny": Profile(
        "tiny",
        overhead.Settings(warmup=2, pairs=5, concurrency=4, rounds=1, seconds=0.3),
        sweep.Settings(levels=(1, 4), seconds=0.2),
        streaming.Settings(
            ttft_pairs=3, chunks=50, concurrency=2, seconds=0.3, rounds=1,
            gap_streams=1, gap_chunks=10, gap_rate=200,
        ),
        floor.Settings(warmup=2, pairs=5, rounds=1, seconds=0.2),
        scale.Settings(
            providers=1000, nodes=100, decisions=200, queue_waiters=200,
            registration_nodes=3, providers_per_node=2,
        ),
        edges.Settings(levels=(4,), seconds=0.2, rounds=1, postgres=False),
        realmodel.Settings(rounds=1, tokens=4),
        None,
        None,
        litellm=False,
        routers=True,  # they start in well under a second: the smoke run covers them
        run_timeout_s=95,  # 80 before the edges scenario, which takes about 10 s here
    ),
    "quick": Profile(
        "quick",
        overhead.Settings(warmup=30, pairs=300, concurrency=64, rounds=2, seconds=4.0),
        sweep.Settings(levels=(1, 16, 64, 256), seconds=2.0),
        streaming.Settings(
            ttft_pairs=100, chunks=1000, concurrency=8, seconds=4.0, rounds=1,
            gap_streams=8, gap_chunks=100, gap_rate=200,
        ),
        floor.Settings(warmup=50, pairs=300, rounds=2, seconds=3.0),
        scale.Settings(
            providers=1000, nodes=100, decisions=20_000, queue_waiters=10_000,
            registration_nodes=100,
        ),
        edges.Settings(levels=(16, 64), seconds=3.0, rounds=2, postgres=True),
        realmodel.Settings(rounds=12, tokens=64),
        vllm_pool.Settings(rounds=6, tokens=64, pool_seconds=20.0, pool_streams=5),
        agents.Settings(
            Workload(sessions=6, turns=4, concurrency=4, system_tokens=300, user_tokens=60,
                     max_tokens=24),
            loads=("agent",),
        ),
        litellm=True,
        routers=True,
        run_timeout_s=1500,
    ),
    "full": Profile(
        "full",
        overhead.Settings(warmup=100, pairs=2000, concurrency=64, rounds=5, seconds=10.0),
        sweep.Settings(levels=(1, 16, 64, 256), seconds=6.0),
        streaming.Settings(
            ttft_pairs=500, chunks=1000, concurrency=8, seconds=10.0, rounds=3,
            gap_streams=30, gap_chunks=200, gap_rate=200,
        ),
        floor.Settings(warmup=100, pairs=1000, rounds=3, seconds=8.0),
        scale.Settings(
            providers=1000, nodes=100, decisions=50_000, queue_waiters=10_000,
            registration_nodes=100,
        ),
        edges.Settings(levels=(16, 64), seconds=8.0, rounds=3, postgres=True),
        realmodel.Settings(rounds=20, tokens=128),
        vllm_pool.Settings(rounds=12, tokens=128, pool_seconds=60.0, pool_streams=5),
        agents.Settings(
            Workload(sessions=12, turns=6, concurrency=4, system_tokens=300, user_tokens=60,
                     max_tokens=24),
        ),
        litellm=True,
        routers=True,
        run_timeout_s=3600,
    ),
}  # fmt: skip


class Report:
    """The scenarios' results as they come, with the machine they ran on."""

    def __init__(self, profile: Profile, only: tuple[str, ...] = SCENARIOS) -> None:
        self.profile = profile
        self.wanted = only
        self.results: dict[str, ScenarioResult] = {}
        self.meta: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "mode": profile.name,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "load_average_at_start": os.getloadavg(),
            },
            "litellm_version": litellm_version(),
            **{f"{kind.name}_version": kind.installed_version() for kind in ROUTERS},
            "scenarios_selected": list(only),
        }

    async def scenario(
        self, name: str, body: Callable[[], Awaitable[ScenarioResult]]
    ) -> ScenarioResult:
        """Run one scenario; an error fails it (with the traceback kept), not the run."""
        if name not in self.wanted:
            self.skip(name, "not selected (--only)")
            return self.results[name]
        print(f"-- {name} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            result = await body()
        except Exception as exc:
            traceback.print_exc()
            result = ScenarioResult(name, status="failed", reason=f"{type(exc).__name__}: {exc}")
        result.seconds = time.monotonic() - started
        result.data.setdefault("load_average_after", os.getloadavg())
        self.results[name] = result
        print(f"   {name}: {result.status} in {result.seconds:.1f} s", file=sys.stderr)
        return result

    def skip(self, name: str, reason: str) -> None:
        self.results[name] = ScenarioResult(name, status="skipped", reason=reason)

    @property
    def rows(self) -> list[Row]:
        return [
            row for name in SCENARIOS if name in self.results for row in self.results[name].rows
        ]

    @property
    def failed(self) -> list[str]:
        return [name for name, result in self.results.items() if result.status == "failed"]

    def as_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "scenarios": {
                name: self.results[name].as_json() for name in SCENARIOS if name in self.results
            },
            "rows": [row.as_json() for row in self.rows],
        }


async def _gateways(report: Report, root: Path) -> None:
    """The scenarios that need the gateways: overhead, streaming, the real model."""
    profile = report.profile
    if not set(GATEWAY_SCENARIOS) & set(report.wanted):
        for name in GATEWAY_SCENARIOS:
            report.skip(name, "not selected (--only)")
        return
    llama_missing = llamacpp_missing()
    if not {"realmodel", "vllm"} & set(report.wanted):
        llama_missing = "not selected (--only)"
    vllm_absent = vllm_missing() or llama_missing
    if "vllm" not in report.wanted:
        vllm_absent = "not selected (--only)"
    elif profile.vllm is None:
        vllm_absent = f"not run in --{profile.name} (vLLM takes about a minute to start)"
    async with contextlib.AsyncExitStack() as exits:
        models = (FAKE_MODEL, f"{FAKE_MODEL}-r{profile.streaming.gap_rate}")
        fake_url, _ = await exits.enter_async_context(
            fake_backend(root / "fake-backend.log", *models)
        )
        providers = [ProviderSpec("bench-fake", "openai_api", "api", models, endpoint=fake_url)]
        llama = None
        if llama_missing is None:
            try:
                llama = await exits.enter_async_context(llamacpp(root / "llamacpp.log"))
            except Exception as exc:  # the real model is optional; the rest still runs
                llama_missing = f"llama.cpp did not start: {exc}"
        if llama is not None:
            providers.append(
                ProviderSpec(
                    "bench-llamacpp",
                    "llamacpp",
                    "local_inference",
                    (SMOLLM2,),
                    endpoint=llama.url,
                    capacity=1,
                )
            )
        engine = None
        pools: dict[str, dict[str, str]] = {}
        if vllm_absent is None and llama is not None:
            print("   starting vLLM (~50 s)", file=sys.stderr, flush=True)
            try:
                engine = await exits.enter_async_context(vllm(root / "vllm.log"))
            except Exception as exc:  # optional, as llama.cpp is
                vllm_absent = f"vLLM did not start: {exc}"
        if engine is not None:
            providers.append(
                ProviderSpec(
                    "bench-vllm",
                    "vllm",
                    "local_inference",
                    (SMOLLM2_VLLM,),
                    endpoint=engine.url,
                    capacity=4,
                )
            )
            pools[vllm_pool.POOL_MODEL] = {"bench-llamacpp": SMOLLM2, "bench-vllm": SMOLLM2_VLLM}
        print("   starting IOP (control-plane, edge, node)", file=sys.stderr, flush=True)
        iop = await exits.enter_async_context(start_iop(root / "iop", providers, pools=pools))
        targets = {
            "direct": Target("direct", f"{fake_url}/v1", FAKE_MODEL),
            "iop": Target("iop", iop.api_url, FAKE_MODEL),
        }
        gateways: dict[str, Gateway] = {"iop": iop.gateway()}
        missing = await _peers(report, exits, root, fake_url, models, targets, gateways)

        await report.scenario(
            "overhead", lambda: overhead.run(targets, gateways, profile.overhead, missing)
        )
        await report.scenario("sweep", lambda: sweep.run(targets, profile.sweep, missing))
        await report.scenario(
            "streaming", lambda: streaming.run(targets, profile.streaming, missing)
        )
        if llama is None:
            report.skip("realmodel", llama_missing or "llama.cpp did not start")
        else:
            real = {
                "direct": Target("direct", f"{llama.url}/v1", SMOLLM2),
                "iop": Target("iop", iop.api_url, SMOLLM2),
            }
            await report.scenario("realmodel", lambda: realmodel.run(real, profile.realmodel))
        if engine is None or llama is None or profile.vllm is None:
            report.skip("vllm", vllm_absent or "vLLM did not start")
        else:
            direct = {
                "direct": Target("direct", f"{engine.url}/v1", SMOLLM2_VLLM),
                "iop": Target("iop", iop.api_url, SMOLLM2_VLLM),
            }
            pool = Target("iop", iop.api_url, vllm_pool.POOL_MODEL)
            members = {
                "llamacpp": vllm_pool.Member(Target("llamacpp", f"{llama.url}/v1", SMOLLM2), 1),
                "vllm": vllm_pool.Member(Target("vllm", f"{engine.url}/v1", SMOLLM2_VLLM), 4),
            }
            settings = profile.vllm
            await report.scenario("vllm", lambda: vllm_pool.run(direct, pool, members, settings))


async def _peers(
    report: Report,
    exits: contextlib.AsyncExitStack,
    root: Path,
    fake_url: str,
    models: tuple[str, ...],
    targets: dict[str, Target],
    gateways: dict[str, Gateway],
) -> dict[str, str]:
    """Start the peers this run measures (into ``targets`` and ``gateways``); returns why
    each other one is not measured, for its column."""
    profile = report.profile
    missing: dict[str, str] = {}
    if not set(PEER_SCENARIOS) & set(report.wanted):
        missing = dict.fromkeys(PEERS, "skipped (not selected)")
    if not profile.litellm:
        missing.setdefault("litellm", f"skipped (not run in --{profile.name})")
    elif not litellm_available():
        missing.setdefault("litellm", SKIPPED)
    if "litellm" not in missing:
        print("   starting LiteLLM (~30 s)", file=sys.stderr, flush=True)
        try:
            lite = await exits.enter_async_context(
                start_litellm(root / "litellm", fake_url, models)
            )
        except Exception as exc:  # a broken peer must not cost IOP its measurement
            traceback.print_exc()
            missing["litellm"] = f"skipped (LiteLLM did not start: {type(exc).__name__})"
        else:
            targets["litellm"] = Target("litellm", lite.base_url, FAKE_MODEL)
            gateways["litellm"] = lite.gateway()
    for kind in ROUTERS:
        if kind.name in missing:
            continue
        if not profile.routers:
            missing[kind.name] = f"skipped (not run in --{profile.name})"
            continue
        if not kind.available():
            missing[kind.name] = kind.missing()
            continue
        print(f"   starting {kind.package}", file=sys.stderr, flush=True)
        try:
            router = await exits.enter_async_context(
                start_router(kind, root / kind.name, fake_url, FAKE_MODEL)
            )
        except Exception as exc:  # as LiteLLM: IOP is measured whatever a peer does
            traceback.print_exc()
            missing[kind.name] = f"skipped ({kind.package} did not start: {type(exc).__name__})"
        else:
            targets[kind.name] = Target(kind.name, router.base_url, FAKE_MODEL)
            gateways[kind.name] = router.gateway()
    for name in PEERS:
        report.meta[name] = "used" if name in targets else missing[name]
    return missing


async def main(
    profile: Profile,
    only: tuple[str, ...] = SCENARIOS,
    agents_targets: tuple[str, ...] = agents.TARGETS,
    agents_loads: tuple[str, ...] | None = None,
) -> Report:
    """Every scenario (or those in ``only``), each bounded; failures are held, never raised."""
    report = Report(profile, only)
    report.meta["smg_version"] = SMG.installed_version()
    report.meta["agents_targets"] = list(agents_targets)
    with tempfile.TemporaryDirectory(prefix="iop-bench-") as scratch:
        root = Path(scratch)
        try:
            async with asyncio.timeout(profile.run_timeout_s):
                try:
                    await _gateways(report, root)
                except Exception as exc:  # a stack that did not start fails what it hosts
                    traceback.print_exc()
                    for name in GATEWAY_SCENARIOS:
                        if name not in report.results:
                            report.results[name] = ScenarioResult(
                                name, status="failed", reason=f"{type(exc).__name__}: {exc}"
                            )
                # The floor, scale and edges scenarios start stacks of their own: after the
                # gateways stopped, so the machine is quiet for them.
                await report.scenario("floor", lambda: floor.run(root / "floor", profile.floor))
                await report.scenario("scale", lambda: scale.run(root / "scale", profile.scale))
                await report.scenario("edges", lambda: edges.run(root / "edges", profile.edges))
                await _agents(report, root / "agents", agents_targets, agents_loads)
        except TimeoutError:
            for name in SCENARIOS:
                report.results.setdefault(
                    name,
                    ScenarioResult(
                        name, status="failed", reason=f"run passed {profile.run_timeout_s:g} s"
                    ),
                )
    return report


async def _agents(
    report: Report, root: Path, targets: tuple[str, ...], loads: tuple[str, ...] | None
) -> None:
    """Last: three engines and a gateway at a time, started and stopped per target;
    ``loads``: the workloads to run (default: the profile's)."""
    settings = report.profile.agents
    if settings is not None and loads is not None:
        settings = dataclasses.replace(settings, loads=loads)
    if settings is None:
        report.skip("agents", f"not run in --{report.profile.name} (minutes of real prefill)")
    elif (missing := llamacpp_missing()) is not None:
        report.skip("agents", missing)
    else:
        await report.scenario("agents", lambda: agents.run(root, settings, targets))


def write(report: Report, out: Path) -> None:
    """The JSON document, then the table and what did not run, on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.as_json(), indent=2) + "\n")
    print()
    print(render(report.rows))
    print()
    for name in SCENARIOS:  # a scenario with more columns than the shared table has
        table = report.results[name].data.get("table")
        if isinstance(table, str):
            print(f"{name}:\n{table}\n")
    for name in SCENARIOS:
        result = report.results[name]
        if result.status != "ok":
            print(f"{name}: {result.status}: {result.reason}")
    print(f"results: {out}")


def _run(coro: Coroutine[Any, Any, Report]) -> Report:
    """uvloop when installed: the client must not be the slowest part of the run."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _agents_targets(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(names) - set(agents.TARGETS))
    if unknown or not names:
        known = ", ".join(agents.TARGETS)
        raise argparse.ArgumentTypeError(
            f"unknown target(s) {', '.join(unknown) or '(none)'}; known: {known}"
        )
    return names


def _agents_loads(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or set(names) - set(agents.LOADS):
        raise argparse.ArgumentTypeError(f"known workloads: {', '.join(agents.LOADS)}")
    return names


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    for name, help_text in (
        ("tiny", "a handful of requests per scenario (the CI smoke run)"),
        ("quick", "the default: about 6 minutes on 2 cores, plus the agents scenario"),
        ("full", "more requests and longer rounds"),
    ):
        mode.add_argument(
            f"--{name}", dest="mode", action="store_const", const=name, help=help_text
        )
    parser.add_argument("--out", type=Path, default=None, help="the JSON results file")
    parser.add_argument(
        "--only",
        action="append",
        choices=SCENARIOS,
        help="run this scenario (repeatable; default: all), e.g. while working on one figure",
    )
    parser.add_argument(
        "--agents-targets",
        type=_agents_targets,
        default=agents.TARGETS,
        help="the agents scenario's targets, comma-separated (default: all of "
        f"{','.join(agents.TARGETS)})",
    )
    parser.add_argument(
        "--agents-loads",
        type=_agents_loads,
        default=None,
        help=f"the agents scenario's workloads, comma-separated, of {','.join(agents.LOADS)}"
        " (default: the profile's)",
    )
    args = parser.parse_args()
    profile = PROFILES[args.mode or "quick"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("var/bench") / f"results-{stamp}.json"
    report = _run(
        main(profile, tuple(args.only or SCENARIOS), args.agents_targets, args.agents_loads)
    )
    write(report, out)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(cli())
