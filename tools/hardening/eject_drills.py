"""Issue 29, item 6: how many providers one tenant's failure drills eject, and what the
other keys get meanwhile.

Starts the soak's stack (``tools/soak.py``: control-plane, edge, node-a, node-b and the
worker as processes, mTLS, every port 0; ``mock-small`` served by a mock on each node;
the edge at its default settings), issues two plain (non-operator) keys, then:

1. the tenant sends ``--drills`` requests asking the mock to fail
   (``"iop_mock": {"fail": "provider_error"}``);
2. the catalog says how many of ``mock-small``'s providers are ejected;
3. for ``--window`` seconds the other key asks ``mock-small`` again and again; its
   answers are counted by status.

Runs against whichever checkout the venv imports (``PYTHONPATH`` of another checkout's
``src`` folders measures that one): the same script before and after.

    .venv/bin/python tools/hardening/eject_drills.py [--drills 5] [--window 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from soak import Stack  # the soak's stack, one copy of it

MODEL = "mock-small"
DRILL = {"iop_mock": {"fail": "provider_error"}}


async def ask(http: aiohttp.ClientSession, stack: Stack, key: str, extra: dict[str, Any]) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(
        f"{stack.api_url}/chat/completions",
        json={**body, **extra},
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        await response.read()
        return response.status


async def ejected(http: aiohttp.ClientSession, stack: Stack, key: str) -> list[str]:
    url = stack.api_url.replace("/v1", "/iop/v1/catalog/providers")
    async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as response:
        rows = (await response.json())["data"]
    return [r["provider_id"] for r in rows if r.get("outlier_state") == "ejected"]


async def measure(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix="eject-drills-") as root:
        stack = Stack(Path(root))
        try:
            await stack.start()
            tenant, other = await stack.issue_key("tenant"), await stack.issue_key("other")
            async with aiohttp.ClientSession() as http:
                async with asyncio.timeout(60):  # until the edge has the keys (its poll)
                    while await ask(http, stack, other, {}) != 200:  # noqa: ASYNC110
                        await asyncio.sleep(0.2)
                drills = Counter(
                    [await ask(http, stack, tenant, DRILL) for _ in range(args.drills)]
                )
                out = await ejected(http, stack, other)
                answers: Counter[int] = Counter()
                end = time.monotonic() + args.window
                while time.monotonic() < end:
                    answers[await ask(http, stack, other, {})] += 1
                    await asyncio.sleep(0.25)
        finally:
            await stack.stop()
    return (
        f"tenant's {args.drills} drills answered {dict(drills)}; providers of {MODEL} ejected"
        f" after them: {len(out)} of 2 {out}; the other key over the next {args.window:g}s:"
        f" {sum(answers.values())} requests, {answers[503]} answered 503 {dict(answers)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drills", type=int, default=5)
    parser.add_argument("--window", type=float, default=30.0)
    print(asyncio.run(measure(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
