"""Write system calls per run, by socket and direction, for one or more IOP checkouts.

    tools/hardening/link_writes.py CHECKOUT [CHECKOUT ...] [--runs 200] [--tokens 8]

For each checkout (its sources on ``PYTHONPATH``, as ``tools/bench/ab.py`` runs
them): one fake backend and one IOP stack, warmed up; then ``strace`` follows the
edge and the node while ``--runs`` non-streamed and then ``--runs`` streamed
(``--tokens`` chunks) chat requests go through one after another (c=1), and the
write calls (``write``, ``writev``, ``sendto``, ``sendmsg``), the read calls and the
event loops' ``epoll_wait``s (one per loop pass that waited) are counted per socket,
named from its process's side: the mTLS link (the edge's end, the node's), the
client's connection on the edge, the provider's on the node, and the rest (the
loops' wake-up eventfds, which threads such as aiosqlite's write). Each count is
divided by the runs.
Needs ``strace`` and ptrace rights over the services (root).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backends import fake_backend
from bench.client import Target, complete, session, stream
from bench.stack import ProviderSpec, start_iop

SOURCES = (
    "proto/src",
    *(f"services/{name}/src" for name in ("edge", "node", "control-plane", "worker")),
)
WRITES = ("write", "writev", "sendto", "sendmsg")
READS = ("read", "readv", "recvfrom", "recvmsg")
CALLS = ",".join((*WRITES, *READS, "epoll_wait", "epoll_pwait"))
# strace -y: ``123 writev(7<TCP:[127.0.0.1:5000->127.0.0.1:6000]>, ...``
LINE = re.compile(r"^(\d+)\s+(\w+)\((\d+)<((?:->|[^>])*)>")
TCP = re.compile(r"TCP:\[[\d.]+:(\d+)->[\d.]+:(\d+)\]")


def _classify(process: str, target: str, ports: dict[str, int]) -> str:
    """The socket a call was made on, named from its process's side."""
    tcp = TCP.search(target)
    if tcp is None:
        return f"{process}: {target.split(':')[0] or 'fd'}"
    local, remote = int(tcp.group(1)), int(tcp.group(2))
    if process == "edge" and local == ports["link"]:
        return "edge: link to the node"
    if process == "node" and remote == ports["link"]:
        return "node: link to the edge"
    if process == "edge" and local == ports["api"]:
        return "edge: client's connection"
    if process == "node" and remote == ports["provider"]:
        return "node: provider's connection"
    return f"{process}: other tcp"


async def _traced(
    pids: dict[str, int], out: Path, ports: dict[str, int], work: object
) -> collections.Counter[str]:
    """Run ``work`` (a coroutine) under strace on each process; counts by socket kind."""
    strace = shutil.which("strace")
    if strace is None:
        raise SystemExit("strace is not installed")
    tracers = {}
    for name, pid in pids.items():
        tracers[name] = await asyncio.create_subprocess_exec(
            strace, "-f", "-qq", "-yy", "-e", f"trace={CALLS}", "-o", str(out / name),
            "-p", str(pid), stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    await asyncio.sleep(1.0)  # strace attaches to every thread before the work starts
    await work  # type: ignore[misc]
    await asyncio.sleep(0.5)  # the write-behind SQLite batches of the last runs
    for tracer in tracers.values():
        tracer.terminate()
        await tracer.wait()
    counts: collections.Counter[str] = collections.Counter()
    for name in pids:
        for line in (out / name).read_text().splitlines():
            match = LINE.match(line)
            if match is None:
                continue
            call = match.group(2)
            if call.startswith("epoll"):
                counts[f"{name}: event loop, epoll waits (wake-ups)"] += 1
                continue
            kind = _classify(name, match.group(4), ports)
            counts[f"{kind}, {'reads' if call in READS else 'writes'}"] += 1
    return counts


async def measure(checkout: Path, runs: int, tokens: int) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(str(checkout / part) for part in SOURCES)
    with tempfile.TemporaryDirectory(prefix="iop-writes-") as scratch:
        root = Path(scratch)
        async with fake_backend(root / "fake.log", "fake") as (url, _):
            spec = ProviderSpec("bench-fake", "openai_api", "api", ("fake",), endpoint=url)
            async with start_iop(root / "iop", [spec]) as iop:
                target = Target("iop", iop.api_url, "fake")
                ports = {
                    "link": iop.core.node_port,
                    "api": int(iop.api_url.rsplit(":", 1)[1].split("/")[0]),
                    "provider": int(url.rsplit(":", 1)[1].split("/")[0]),
                }
                pids = iop.gateway().roots
                async with session(1) as http:
                    for _ in range(20):
                        await complete(http, target)
                        await stream(http, target, tokens, timed=False)

                    async def plain() -> None:
                        for _ in range(runs):
                            await complete(http, target)

                    async def streamed() -> None:
                        for _ in range(runs):
                            await stream(http, target, tokens, timed=False)

                    for label, work in (("non-streamed", plain), ("streamed", streamed)):
                        out = root / label
                        out.mkdir()
                        counts = await _traced(pids, out, ports, work())
                        print(f"{checkout} {label} ({runs} runs, calls per run):")
                        for kind in sorted(counts):
                            print(f"  {counts[kind] / runs:6.2f}  {kind}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", type=Path, nargs="+")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8, help="chunks per streamed run")
    args = parser.parse_args()
    for checkout in args.checkouts:
        asyncio.run(measure(checkout.resolve(), args.runs, args.tokens))


if __name__ == "__main__":
    cli()
