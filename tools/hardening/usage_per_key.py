"""Who used what: does the run log, the metrics and a usage view say which key and API?

    .venv/bin/python tools/hardening/usage_per_key.py [CHECKOUT]

Starts the end-to-end tests' stack (``tests/conftest.py:start_stack``: control-plane,
edge, two nodes of mock providers, a worker) from ``CHECKOUT``'s sources (default: this
one; its sources go first on the services' ``PYTHONPATH``). Issues three keys (an
operator's, alice's, bob's), then alice sends one request through each of chat
completions (one of them streamed), completions, embeddings and responses, bob two
Messages requests and a batch of three lines. Printed: the runs the run log holds of
what was sent (by key and API, as it says them), the metric series that carry a key
and an API, and what ``GET /iop/v1/usage`` answers.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCES = (
    "proto/src",
    "services/edge/src",
    "services/node/src",
    "services/control-plane/src",
    "services/worker/src",
)
MODEL = "mock-small"
CHAT = [{"role": "user", "content": "hi"}]


def load_stack() -> Any:
    """``tests/conftest.py`` of this checkout, as a module (its ``start_stack``)."""
    spec = importlib.util.spec_from_file_location("iop_e2e_stack", ROOT / "tests" / "conftest.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def call(
    http: aiohttp.ClientSession, method: str, url: str, key: str, **kwargs: Any
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.request(method, url, headers=headers, **kwargs) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


async def key_id_of(stack: Any, name: str) -> str:
    out = await stack.control_plane_cli("key", "list")
    line = next(line for line in out.splitlines() if re.search(rf"\b{name}\b", line))
    found = re.search(r"\bkey_[0-9a-f]+\b", line)
    assert found is not None, out
    return found.group(0)


async def traffic(stack: Any, http: aiohttp.ClientSession, alice: str, bob: str) -> None:
    api = stack.api_url
    for path, body in (
        ("/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 5}),
        ("/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True}),
        ("/completions", {"model": MODEL, "prompt": "once upon", "max_tokens": 5}),
        ("/embeddings", {"model": MODEL, "input": "embed me"}),
        ("/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5}),
    ):
        status, _ = await call(http, "POST", f"{api}{path}", alice, json=body)
        assert status == 200, (path, status)
    for _ in range(2):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 5}
        status, _ = await call(http, "POST", f"{api}/messages", bob, json=body)
        assert status == 200
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": CHAT, "max_tokens": 5},
            }
        )
        + "\n"
        for n in range(3)
    )
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", lines.encode(), filename="lines.jsonl")
    status, upload = await call(http, "POST", f"{api}/files", bob, data=form)
    assert status == 200, upload
    body = {
        "input_file_id": upload["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    status, batch = await call(http, "POST", f"{api}/batches", bob, json=body)
    assert status == 200, batch
    async with asyncio.timeout(90):
        while batch["status"] != "completed":
            await asyncio.sleep(0.2)  # the worker is another process
            _, batch = await call(http, "GET", f"{api}/batches/{batch['id']}", bob)


async def measure(checkout: Path) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(str(checkout / s) for s in SOURCES)
    conftest = load_stack()
    with tempfile.TemporaryDirectory(prefix="iop-usage-") as scratch:
        async with conftest.start_stack(Path(scratch), conftest.FLEET) as stack:
            ops = await stack.issue_key("ops", "--operator")
            alice = await stack.issue_key("alice")
            bob = await stack.issue_key("bob", "--max-concurrent", "3")
            names = {await key_id_of(stack, n): n for n in ("ops", "alice", "bob")}
            edge = stack.api_url.removesuffix("/v1")
            async with aiohttp.ClientSession() as http:
                await traffic(stack, http, alice, bob)
                await asyncio.sleep(1.0)  # the run log writes every 0.25 s
                _, runs = await call(http, "GET", f"{edge}/iop/v1/runs?limit=1000", ops)
                records = runs["data"]
                async with http.get(f"{stack.edge_admin}/metrics") as response:
                    metrics = await response.text()
                status, usage = await call(http, "GET", f"{edge}/iop/v1/usage", ops)
    sent = 5 + 2 + 3
    said = Counter(
        (names.get(r["key_id"], r["key_id"] or "-"), r.get("api", "(no api field)"))
        for r in records
    )
    print(f"checkout: {checkout}")
    print(f"runs sent: {sent} (alice: 5 over 4 APIs; bob: 2 messages, a batch of 3 lines)")
    print(f"runs in the run log: {len(records)}")
    for (name, api), count in sorted(said.items()):
        print(f"  key {name:6} api {api:18} {count}")
    attributed = sum(n for (name, api), n in said.items() if name != "-" and api[:1] != "(")
    print(f"runs with a key and an API: {attributed} of {sent}")
    labelled = [
        line
        for line in metrics.splitlines()
        if line.startswith("iop_edge_requests_total{") and 'key="' in line and 'api="' in line
    ]
    print(f"iop_edge_requests_total series with key and api labels: {len(labelled)}")
    print(f"GET /iop/v1/usage: HTTP {status}")
    if status == 200:
        for view in usage["data"]:
            day = view["day"]
            split = {api: c["requests"] for api, c in day["by_api"].items()}
            name = names.get(view["key_id"], view["key_id"])
            print(f"  {name:6} today: {day['requests']} requests, {day['tokens']} tokens, {split}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=ROOT)
    args = parser.parse_args()
    sys.path.insert(0, str(args.checkout.resolve() / "proto" / "src"))
    asyncio.run(measure(args.checkout.resolve()))


if __name__ == "__main__":
    main()
