"""Taking a provider out of service with work on it, and back: runtime control (issue 34)
against what a checkout without it has, the fleet file.

    .venv/bin/python tools/hardening/runtime_control.py

Runs from a checkout's root on the real stack of ``tests/conftest.py`` (control-plane,
edge, two nodes as processes over mTLS; the open API). The model ``ctl`` has one mock
provider on each node, one slot each: a 3 s stream holds node-a's, a 5 s stream
node-b's, and three requests wait in the edge's queue. Then node-a's provider is taken
out: ``POST /iop/v1/controls`` (a drain) where the edge has it, else the only way
before it: the provider removed from the fleet file and ``config reload``. Printed: the
seconds until the edge stops choosing it, how each request ended and where it ran, and
the seconds until it is chosen again once put back (``enable``, or the file restored).
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT / "tests"))
import conftest  # noqa: E402  (tests/conftest.py: the real stack)

A, B = "node-a-ctl", "node-b-ctl"


def provider(node: str) -> dict[str, object]:
    return {
        "id": f"{node}-ctl",
        "type": "mock",
        "category": "local_inference",
        "models": [f"ctl-{node[-1]}"],
        "capacity": 1,
        "max_queue": 8,
        "queue_timeout_ms": 30_000,
        "request_timeout_ms": 60_000,
        "tokens_per_second": 50,
    }


FLEET: dict[str, Any] = {
    "models": [{"id": "ctl", "providers": {A: "ctl-a", B: "ctl-b"}}],
    "nodes": [{"id": n, "providers": [provider(n)]} for n in ("node-a", "node-b")],
}


def body(tokens: int) -> dict[str, Any]:
    return {
        "model": "ctl",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": tokens,
        "stream": True,
        "iop_mock": {"fill": True},
    }


async def stream(http: aiohttp.ClientSession, api: str, tokens: int) -> str:
    async with http.post(f"{api}/chat/completions", json=body(tokens)) as answer:
        if answer.status != 200:
            return f"HTTP {answer.status}"
        text = (await answer.read()).decode()
    if '"error"' in text:
        return "error in the stream"
    return "completed" if "[DONE]" in text and "finish_reason" in text else "cut"


async def catalog(http: aiohttp.ClientSession, api: str) -> dict[str, Any]:
    async with http.get(api.replace("/v1", "/iop/v1/catalog/providers")) as answer:
        return {row["provider_id"]: row for row in (await answer.json())["data"]}


async def until(check: Any, timeout_s: float = 60) -> float:
    began = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - other processes' state
            await asyncio.sleep(0.01)
    return time.monotonic() - began


async def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="controls-"))
    async with conftest.start_stack(root, FLEET) as stack, aiohttp.ClientSession() as http:
        api = stack.api_url
        controls = api.replace("/v1", "/iop/v1/controls")
        async with http.get(controls) as probe:
            has_controls = probe.status == 200
        print(f"runtime control: {'yes' if has_controls else 'no (the fleet file instead)'}")

        def chosen(yes: bool) -> Any:
            async def check() -> bool:
                row = (await catalog(http, api)).get(A)
                usable = row is not None and row["capacity"] > 0 and row["connected"]
                return usable is yes

            return check

        async def busy(provider_id: str) -> bool:
            return (await catalog(http, api))[provider_id]["in_flight"] >= 1

        since = int(time.time() * 1000)
        on_a = asyncio.create_task(stream(http, api, 150))
        await until(lambda: busy(A))
        on_b = asyncio.create_task(stream(http, api, 250))
        await until(lambda: busy(B))
        queued = [asyncio.create_task(stream(http, api, 3)) for _ in range(3)]
        await asyncio.sleep(0.3)  # the three are in the edge's queue (one slot each, both held)

        began = time.monotonic()
        if has_controls:
            change = {"kind": "state", "target": f"node-a/{A}", "value": "draining"}
            async with http.post(controls, json=change) as answer:
                assert answer.status == 200, await answer.text()
        else:
            fleet = copy.deepcopy(FLEET)
            del fleet["models"][0]["providers"][A]
            fleet["nodes"][0]["providers"] = []
            stack.fleet_file.write_text(yaml.safe_dump(fleet))
            await stack.control_plane_cli("config", "reload")
        out_s = time.monotonic() - began + await until(chosen(False))
        ends = await asyncio.gather(on_a, on_b, *queued)
        done_s = time.monotonic() - began
        await asyncio.sleep(0.5)  # the run log is written off the request path
        async with http.get(api.replace("/v1", "/iop/v1/runs"), params={"limit": 50}) as answer:
            runs = [r for r in (await answer.json())["data"] if r["received_ms"] >= since]
        where = sorted((r["received_ms"], r["provider_id"] or "-", r["outcome"]) for r in runs)

        began = time.monotonic()
        if has_controls:
            change = {"kind": "state", "target": f"node-a/{A}", "value": ""}
            async with http.post(controls, json=change) as answer:
                assert answer.status == 200, await answer.text()
        else:
            stack.fleet_file.write_text(yaml.safe_dump(FLEET))
            await stack.control_plane_cli("config", "reload")
        back_s = time.monotonic() - began + await until(chosen(True))
        print(
            json.dumps(
                {
                    "out_of_selection_s": round(out_s, 3),
                    "stream_on_taken_out_provider": ends[0],
                    "stream_on_other_provider": ends[1],
                    "queued_requests": ends[2:],
                    "ran_on": [provider_id for _, provider_id, _ in where],
                    "all_done_s": round(done_s, 2),
                    "back_in_selection_s": round(back_s, 3),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    asyncio.run(main())
