"""Issue 32, limits per key: how many requests a key gets through in a minute, on the
checkout the venv imports (``PYTHONPATH`` of another checkout's ``src`` folders measures
that one, its services included: they inherit it): the same script before and after.

A real stack (tests/conftest.py's ``start_stack``: control-plane, edge, two nodes with
mock providers), a key issued with ``--rpm N`` (a checkout without the flag gets a key
without limits, and says so), then ``--clients`` clients send short requests back to
back for ``--seconds``. Printed: the answers by status and code, the most admitted in any
sliding minute against the limit, and the rate-limit headers of the last answer.

    PYTHONPATH=CHECKOUT/proto/src:CHECKOUT/services/edge/src:... \\
        .venv/bin/python tools/hardening/key_rates.py [--rpm 30] [--seconds 60] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]


def _conftest() -> Any:
    spec = importlib.util.spec_from_file_location("stack_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["stack_conftest"] = module
    spec.loader.exec_module(module)
    return module


async def client(
    http: aiohttp.ClientSession, url: str, secret: str, until: float, seen: list[Any]
) -> None:
    body = {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {secret}"}
    while time.monotonic() < until:
        async with http.post(f"{url}/chat/completions", json=body, headers=headers) as answer:
            raw = await answer.read()
            code = "" if answer.status == 200 else json.loads(raw)["error"].get("code", "")
            seen.append((time.monotonic(), answer.status, code, dict(answer.headers)))
            if answer.status == 429:
                await asyncio.sleep(min(1.0, float(answer.headers.get("Retry-After", "1"))))


async def measure(rpm: int, seconds: float, clients: int) -> None:
    conftest = _conftest()
    with tempfile.TemporaryDirectory() as root:
        async with conftest.start_stack(Path(root), conftest.FLEET) as stack:
            try:
                secret = await stack.issue_key("measured", "--rpm", str(rpm))
                limit = f"--rpm {rpm}"
            except AssertionError:
                secret = await stack.issue_key("measured")
                limit = "none (this checkout has no --rpm)"
            seen: list[Any] = []
            until = time.monotonic() + seconds
            async with aiohttp.ClientSession() as http:
                await asyncio.gather(
                    *(client(http, stack.api_url, secret, until, seen) for _ in range(clients))
                )
    admitted = sorted(at for at, status, _, _ in seen if status == 200)
    most, first = 0, 0
    for last, at in enumerate(admitted):  # the most admitted in any 60 s (two pointers)
        while admitted[first] <= at - 60:
            first += 1
        most = max(most, last - first + 1)
    statuses = Counter(f"{status} {code}".strip() for _, status, code, _ in seen)
    print(f"key limit: {limit}; {clients} clients for {seconds:.0f} s")
    print(f"answers: {dict(statuses)}")
    print(f"admitted: {len(admitted)}; most in any sliding minute: {most}")
    if seen:
        last = {k: v for k, v in seen[-1][3].items() if "ratelimit" in k or k == "Retry-After"}
        print(f"last answer's rate-limit headers: {last}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpm", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(measure(args.rpm, args.seconds, args.clients))


if __name__ == "__main__":
    main()
