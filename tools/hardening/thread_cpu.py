"""CPU per request by thread of the edge and the node, for one or more IOP checkouts.

    tools/hardening/thread_cpu.py CHECKOUT [CHECKOUT ...] [--seconds 10] [--concurrency 64]

For each checkout (its sources on ``PYTHONPATH``, as ``tools/bench/ab.py`` runs
them): one fake backend and one IOP stack; non-streamed chat requests at the
given concurrency for ``--seconds``, and each thread's ``utime + stime`` from
``/proc/<pid>/task`` before and after, divided by the requests completed. The
event loop's thread and aiosqlite's writer thread (the run log's on the edge, the
run history's on the node) are told apart, which a sampling profiler cannot do
reliably (a thread blocked on its queue may be sampled as busy). Checkouts run one
after another, not alternated: ``ab.py`` is the comparison; this is the breakdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backends import fake_backend
from bench.client import Target, closed_loop, session
from bench.stack import ProviderSpec, start_iop

SOURCES = (
    "proto/src",
    *(f"services/{name}/src" for name in ("edge", "node", "control-plane", "worker")),
)
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of each thread of ``pid``, by thread id."""
    seconds: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    return seconds


async def measure(checkout: Path, seconds: float, concurrency: int) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(str(checkout / part) for part in SOURCES)
    with tempfile.TemporaryDirectory(prefix="iop-threads-") as scratch:
        root = Path(scratch)
        async with fake_backend(root / "fake.log", "fake") as (url, _):
            spec = ProviderSpec("bench-fake", "openai_api", "api", ("fake",), endpoint=url)
            async with start_iop(root / "iop", [spec]) as iop:
                target = Target("iop", iop.api_url, "fake")
                pids = iop.gateway().roots
                async with session(concurrency) as http:
                    await closed_loop(http, target, concurrency, 1.0)  # warm up
                    before = {name: thread_cpu(pid) for name, pid in pids.items()}
                    done, failed, took = await closed_loop(http, target, concurrency, seconds)
                    after = {name: thread_cpu(pid) for name, pid in pids.items()}
    print(f"{checkout}: {done} requests ({failed} failed), {done / took:.0f} req/s")
    for name, pid in pids.items():
        used = {tid: cpu - before[name].get(tid, 0.0) for tid, cpu in after[name].items()}
        for tid, cpu in sorted(used.items(), key=lambda item: -item[1]):
            if cpu > 0:
                what = "event loop" if tid == pid else f"thread {tid}"
                print(f"  {name} {what:<14} {cpu / done * 1e6:7.1f} us per request")
        print(f"  {name} {'all':<14} {sum(used.values()) / done * 1e6:7.1f} us per request")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", type=Path, nargs="+")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    for checkout in args.checkouts:
        asyncio.run(measure(checkout.resolve(), args.seconds, args.concurrency))


if __name__ == "__main__":
    cli()
