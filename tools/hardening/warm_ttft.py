"""Time to first token of a cold model, and the loads it costs, on two checkouts in one run
(docs/ARCHITECTURE.md#warm-aware-scheduling).

Two Ollama-shaped doubles (``tools/ollama_double.py``: a load takes ``--load-s``, warm
answers at once), each behind a provider of capacity 4 on one node, serve one model. For
each checkout (this one, and ``--base`` if given: its ``services/*/src`` and
``proto/src`` put first on ``PYTHONPATH`` for the services and the stack alike), two
scenarios, on fresh doubles and a fresh stack:

- ``cold``: nothing loaded; a burst of 8 streamed requests.
- ``one-warm``: the second host holds the model (loaded outside the edge, seen by the
  node's probe); a burst of 8.

Printed per checkout and scenario: TTFT p50 and max (client side, from the request to the
first content delta) and the loads the doubles made (their own count).

    .venv/bin/python tools/hardening/warm_ttft.py --base /tmp/base-warm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from bench.stack import ProviderSpec, start_iop  # noqa: E402
from ollama_double import spawned  # noqa: E402

CONTENT = re.compile(rb'"content":\s*"[^"]')  # a delta with text, not the role's alone
MODEL = "llama3"
BURST = 8


async def first_token(api_url: str) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    first = 0.0
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{api_url}/chat/completions", json=body) as response,
    ):
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for raw in response.content:
            if (
                not first
                and raw.startswith(b"data: {")
                and b'"content":"' in raw.replace(b" ", b"")
            ):
                first = loop.time() - started
    return first


async def wait_warm(edge_url: str, provider_id: str) -> None:
    """Until the node reported the preloaded model (an edge without the catalog field: a
    fixed wait of a few probes, as the probe interval is 0.2 s)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        while True:
            async with http.get(f"{edge_url}/iop/v1/catalog/providers") as response:
                rows = (await response.json())["data"]
            row = next(r for r in rows if r["provider_id"] == provider_id)
            if "warmth" not in row:
                await asyncio.sleep(1.0)
                return
            if any(m["warm"] for m in row["warmth"]["models"]):
                return
            await asyncio.sleep(0.1)


async def scenario(name: str, load_s: float) -> dict[str, Any]:
    async with AsyncExitStack() as exits:
        doubles = [
            await exits.enter_async_context(spawned("--models", MODEL, "--load-s", str(load_s)))
            for _ in range(2)
        ]
        providers = [
            ProviderSpec(f"{tag}-ollama", "ollama", "local_inference", (MODEL,), url, capacity=4)
            for tag, url in zip("ab", doubles, strict=True)
        ]
        root = Path(exits.enter_context(tempfile.TemporaryDirectory()))
        stack = await exits.enter_async_context(start_iop(root, providers, probe_interval_s=0.2))
        if name == "one-warm":
            async with aiohttp.ClientSession() as http:
                await (await http.post(f"{doubles[1]}/api/generate", json={"model": MODEL})).read()
            await wait_warm(stack.core.edge_url, "b-ollama")
        before = [await _loads(url) for url in doubles]
        ttfts = await asyncio.gather(*(first_token(stack.api_url) for _ in range(BURST)))
        after = [await _loads(url) for url in doubles]
        return {
            "scenario": name,
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_max_s": round(max(ttfts), 3),
            "loads": sum(after) - sum(before),
        }


async def _loads(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/double/stats") as response:
        return sum((await response.json())["loads"].values())


async def one(label: str, load_s: float) -> None:
    for name in ("cold", "one-warm"):
        result = await scenario(name, load_s)
        print(json.dumps({"checkout": label, **result}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="another checkout to measure first")
    parser.add_argument("--load-s", type=float, default=2.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a label: measure this process's code
    args = parser.parse_args()
    if args.one:
        asyncio.run(one(args.one, args.load_s))
        return
    runs = [("base", args.base)] if args.base else []
    runs.append(("this", None))
    for label, checkout in runs:
        env = dict(os.environ)
        if checkout is not None:
            paths = [checkout / "services" / s / "src" for s in
                     ("control-plane", "edge", "node", "worker")]  # fmt: skip
            paths.append(checkout / "proto" / "src")
            env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
        command = [sys.executable, __file__, "--one", label, "--load-s", str(args.load_s)]
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
