"""Two IOP checkouts side by side in one run: what a change gives, measured the way the
benchmark measures the peers.

    tools/bench/ab.py BASE NEW [--rounds 400] [--seconds 3] [--base-python PY] [--new-python PY]
    # e.g. git worktree add --detach ../base main && tools/bench/ab.py ../base .
    # two interpreters: tools/bench/ab.py . . --new-python var/bench-py313/bin/python

One fake backend, one IOP stack (control-plane, edge, node) from each checkout's
sources (its ``PYTHONPATH`` for the services), and the direct path; requests
alternate direct / base / new, the order rotating each round, so a machine that
slows down (a shared one does) slows all three alike. Prints added p50 / p99 at c=1,
added TTFT p50, c=64 throughput (and its share of direct's) and the gateway's CPU
per 1,000 requests for both, and the new side's ``x-iop-overhead-ms`` p50. Both
checkouts must read each other's databases (the stacks start from scratch, so
only the schema version this process's control-plane writes must be one both know).
``--base-python`` / ``--new-python``: the interpreter a side's services run on (a venv
with the services' dependencies; the sources still come from the checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backends import fake_backend
from bench.client import Target, closed_loop, complete, percentile, rotated, session, stream
from bench.procs import Gateway
from bench.stack import ProviderSpec, start_iop

SOURCES = (
    "proto/src",
    *(f"services/{name}/src" for name in ("edge", "node", "control-plane", "worker")),
)
NAMES = ("direct", "base", "new")


def _pythonpath(checkout: Path) -> str:
    return os.pathsep.join(str(checkout / part) for part in SOURCES)


Samples = dict[str, list[float]]


async def _c1(targets: dict[str, Target], rounds: int) -> tuple[Samples, Samples, Samples]:
    """Latencies and TTFTs at c=1 by target, and the new side's header values."""
    latency: Samples = {name: [] for name in NAMES}
    ttft: Samples = {name: [] for name in NAMES}
    header: Samples = {"new": []}
    async with session(len(NAMES)) as http:
        for name in NAMES:
            for _ in range(30):
                await complete(http, targets[name])
                await stream(http, targets[name], 4)
        for i in range(rounds):
            for name in rotated(NAMES, i):
                own = header["new"] if name == "new" else None
                latency[name].append(await complete(http, targets[name], reported=own))
        for i in range(rounds // 3):
            for name in rotated(NAMES, i):
                ttft[name].append((await stream(http, targets[name], 4)).ttft_s)
    return latency, ttft, header


async def _c64(
    targets: dict[str, Target], gateways: dict[str, Gateway], seconds: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Requests/s at c=64 by target, and CPU seconds per 1,000 requests by gateway."""
    done = dict.fromkeys(NAMES, 0.0)
    elapsed = dict.fromkeys(NAMES, 0.0)
    cpu = dict.fromkeys(gateways, 0.0)
    async with session(64 * len(NAMES)) as http:
        for name in NAMES:
            await closed_loop(http, targets[name], 64, 0.3)
        for i in range(3):
            for name in rotated(NAMES, i):
                gateway = gateways.get(name)
                before = gateway.cpu() if gateway else 0.0
                completed, failed, took = await closed_loop(http, targets[name], 64, seconds)
                if failed:
                    raise RuntimeError(f"{name}: {failed} requests failed at c=64")
                if gateway:
                    cpu[name] += gateway.cpu() - before
                done[name] += completed
                elapsed[name] += took
    rps = {name: done[name] / elapsed[name] for name in NAMES}
    return rps, {name: cpu[name] / done[name] * 1000 for name in gateways}


async def main(sides: dict[str, tuple[Path, str | None]], rounds: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="iop-ab-") as scratch:
        root = Path(scratch)
        async with contextlib.AsyncExitStack() as stack:
            url, _ = await stack.enter_async_context(fake_backend(root / "fake.log", "fake"))
            spec = ProviderSpec("bench-fake", "openai_api", "api", ("fake",), endpoint=url)
            targets = {"direct": Target("direct", f"{url}/v1", "fake")}
            gateways: dict[str, Gateway] = {}
            for name, (checkout, python) in sides.items():
                os.environ["PYTHONPATH"] = _pythonpath(checkout)  # the services' sources
                iop = await stack.enter_async_context(start_iop(root / name, [spec], python=python))
                targets[name] = Target(name, iop.api_url, "fake")
                gateways[name] = iop.gateway()
            latency, ttft, header = await _c1(targets, rounds)
            rps, cpu = await _c64(targets, gateways, seconds)
    p50 = {name: percentile(latency[name], 50) * 1000 for name in NAMES}
    p99 = {name: percentile(latency[name], 99) * 1000 for name in NAMES}
    first = {name: percentile(ttft[name], 50) * 1000 for name in NAMES}
    for name in ("base", "new"):
        print(
            f"{name}: added p50 {p50[name] - p50['direct']:.3f} ms, added p99"
            f" {p99[name] - p99['direct']:.3f} ms, added TTFT p50"
            f" {first[name] - first['direct']:.3f} ms, c=64 {rps[name]:.0f} req/s ="
            f" {rps[name] / rps['direct']:.3f}x direct, CPU {cpu[name]:.2f} s per 1,000"
        )
    print(
        f"direct: p50 {p50['direct']:.3f} ms, c=64 {rps['direct']:.0f} req/s;"
        f" new's x-iop-overhead-ms p50 {percentile(header['new'], 50):.3f} ms"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the checkout to compare against")
    parser.add_argument("new", type=Path, help="the checkout with the change")
    parser.add_argument("--rounds", type=int, default=400, help="c=1 rounds (each target once)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per target per c=64 round")
    for side in ("base", "new"):
        parser.add_argument(f"--{side}-python", help=f"the interpreter of {side}'s services")
    args = parser.parse_args()
    sides = {
        "base": (args.base.resolve(), args.base_python),
        "new": (args.new.resolve(), args.new_python),
    }
    asyncio.run(main(sides, args.rounds, args.seconds))


if __name__ == "__main__":
    cli()
