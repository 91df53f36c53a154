"""Profile the IOP request path: where the edge's and the node's CPU goes under load.

    tools/bench/profile.py [--concurrency 64] [--seconds 15] [--stream] [--out DIR]

Starts the fake backend and an IOP stack (as the benchmark does), drives
non-streamed (or 1,000-chunk streamed) requests through the edge, and samples the
edge and the node with py-spy meanwhile (``--nonblocking``: the processes are not
paused). Prints each process's functions by their own samples and by the samples
they are on the stack for, and writes speedscope files to open in
https://www.speedscope.app. Needs ``py-spy`` (``pip install py-spy``); py-spy needs
ptrace rights over the processes (root, or ``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backends import fake_backend
from bench.client import Target, closed_loop, session, stream
from bench.stack import ProviderSpec, start_iop

TOP = 25


def summarise(raw: Path, top: int = TOP) -> str:
    """Self and inclusive sample counts per function from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{raw.stem}: {total} samples", "  self%  function"]
    lines += [f"  {100 * n / total:5.1f}  {f}" for f, n in own.most_common(top)]
    lines += ["  incl%  function"]
    lines += [f"  {100 * n / total:5.1f}  {f}" for f, n in inclusive.most_common(top * 2)]
    return "\n".join(lines)


async def _record(
    pid: int, seconds: float, out: Path, fmt: str, gil: bool, native: bool = False
) -> asyncio.subprocess.Process:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return await asyncio.create_subprocess_exec(
        spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "250",
        # native frames need the process paused per sample (slower, but they are the point)
        *(["--native"] if native else ["--nonblocking"]),
        "--format", fmt, "--output", str(out), *(["--gil"] if gil else []),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    out: Path = args.out
    with tempfile.TemporaryDirectory(prefix="iop-profile-") as scratch:
        root = Path(scratch)
        async with fake_backend(root / "fake.log", "fake") as (fake_url, _):
            spec = ProviderSpec("bench-fake", "openai_api", "api", ("fake",), endpoint=fake_url)
            async with start_iop(root / "iop", [spec]) as iop:
                target = Target("iop", iop.api_url, "fake")
                pids = iop.gateway().roots
                async with session(args.concurrency) as http:
                    await closed_loop(http, target, args.concurrency, 1.0)  # warm up
                    spies = {
                        (name, fmt): await _record(
                            pid, args.seconds, out / f"{name}.{fmt}", fmt, args.gil, args.native
                        )
                        for name, pid in pids.items()
                        for fmt in ("raw", "speedscope")
                    }
                    if args.stream:
                        loop = asyncio.get_running_loop()
                        end = loop.time() + args.seconds + 1

                        async def streams() -> None:
                            while loop.time() < end:
                                await stream(http, target, 1000, timed=False)

                        async with asyncio.TaskGroup() as group:
                            for _ in range(args.concurrency):
                                group.create_task(streams())
                    else:
                        done, failed, elapsed = await closed_loop(
                            http, target, args.concurrency, args.seconds + 1
                        )
                        print(f"{done / elapsed:.0f} req/s, {failed} failed", file=sys.stderr)
                    for (name, fmt), spy in spies.items():
                        _, err = await spy.communicate()
                        if spy.returncode != 0:
                            print(f"py-spy {name} {fmt}: {err.decode()[-500:]}", file=sys.stderr)
    for name in pids:
        with contextlib.suppress(FileNotFoundError):
            print(summarise(out / f"{name}.raw"))
            print()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--stream", action="store_true", help="1,000-chunk streams instead")
    parser.add_argument(
        "--gil", action="store_true", help="sample only the thread holding the GIL (Python work)"
    )
    parser.add_argument(
        "--native", action="store_true", help="also C frames (uvloop, ssl, protobuf, libc)"
    )
    parser.add_argument("--out", type=Path, default=Path("var/bench/profile"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(args))


if __name__ == "__main__":
    cli()
