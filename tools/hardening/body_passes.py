"""How many times one streamed chat request's body is parsed and written, edge and node.

    .venv/bin/python tools/hardening/body_passes.py [CHECKOUT]

Starts the benchmark's stack (``tools/bench/stack.py``: fake backend, control-plane,
edge, one node with the ``openai_api`` adapter) from ``CHECKOUT``'s sources (default:
this one), with ``body_passes_hook`` on the services' ``PYTHONPATH``: every JSON parse
whose input holds the request's marker and every JSON write whose output holds it is
logged with the function that made it. Sends a few warm-up streams, then one marked
streamed chat completion, and prints the passes per process. A parse or write of a
whole body counts once however many bytes it spans; the provider's answer never holds
the marker (the fake backend answers fixed tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from bench.backends import fake_backend  # noqa: E402
from bench.client import Target, session, stream  # noqa: E402
from bench.procs import descendants  # noqa: E402
from bench.stack import ProviderSpec, start_iop  # noqa: E402

HOOK = Path(__file__).resolve().parent / "body_passes_hook"
SOURCES = ("proto/src", "services/edge/src", "services/node/src", "services/control-plane/src")
MODEL = "fake"


async def measure(checkout: Path) -> dict[str, collections.Counter[str]]:
    marker = f"body-pass-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory(prefix="iop-body-passes-") as scratch:
        root = Path(scratch)
        logs = root / "passes"
        logs.mkdir()
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(HOOK), *(str(checkout / s) for s in SOURCES)]
        )
        os.environ["BODY_PASSES_DIR"] = str(logs)
        os.environ["BODY_PASSES_MARKER"] = marker
        async with fake_backend(root / "fake.log", MODEL) as (fake_url, _):
            spec = ProviderSpec("bench-fake", "openai_api", "api", (MODEL,), endpoint=fake_url)
            async with start_iop(root / "iop", [spec]) as iop, session(2) as http:
                target = Target("iop", iop.api_url, MODEL)
                for _ in range(3):
                    await stream(http, target, 4, timed=False)
                prompt = [{"role": "user", "content": f"say hello ({marker})"}]
                await stream(http, target, 4, timed=False, messages=prompt)
                await asyncio.sleep(1.0)  # the run log's and the history's batched writes
                pids = {
                    pid: name
                    for name, root_pid in iop.gateway().roots.items()
                    for pid in descendants(root_pid)
                }
        found: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for log in logs.glob("*.log"):
            name = pids.get(int(log.stem), f"pid {log.stem}")
            found[name].update(log.read_text().splitlines())
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=ROOT)
    args = parser.parse_args()
    found = asyncio.run(measure(args.checkout.resolve()))
    for name, passes in found.items():
        parses = sum(n for line, n in passes.items() if line.startswith("parse"))
        writes = sum(n for line, n in passes.items() if line.startswith("write"))
        print(f"{name}: body parsed {parses}x, written {writes}x")
        for line, n in sorted(passes.items()):
            print(f"    {n}x {line}")


if __name__ == "__main__":
    main()
