"""Requests waiting in a model's queue across a served-name change and a node's retirement.

    .venv/bin/python tools/hardening/queued_fleet_change.py

Runs from a checkout's root, with the venv whose packages are that checkout's (editable:
``git checkout <commit> -- services/edge/src`` compares another edge). The real stack of
``tests/conftest.py`` (``start_stack``: control-plane, edge and nodes as processes over
mTLS) with the fleet of ``tests/e2e/test_queued_across_fleet_changes.py`` at the default
queue timeout (30 s). Each model's one slot is held by a long stream while requests wait;
then ``config reload`` renames the served name (two waiters), or ``node retire`` removes
the model's only node (one waiter). Printed: each waiter's status, the start of its answer
and the seconds it took.
"""

from __future__ import annotations

import asyncio
import importlib.util
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

_spec = importlib.util.spec_from_file_location(
    "queued", ROOT / "tests/e2e/test_queued_across_fleet_changes.py"
)
assert _spec is not None
assert _spec.loader is not None
scenario: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scenario)


async def ask(stack: Any, model: str) -> tuple[int, str, float]:
    began = time.monotonic()
    async with aiohttp.ClientSession() as http:
        url = f"{stack.api_url}/chat/completions"
        async with http.post(url, json=scenario.body(model, 4)) as answer:
            text = (await answer.read())[:110].decode(errors="replace")
            return answer.status, text, round(time.monotonic() - began, 1)


async def main() -> None:
    scenario.WAIT_S = 30.0  # the fleet file's default queue_timeout_ms
    root = Path(tempfile.mkdtemp(prefix="queued-"))
    async with conftest.start_stack(root, scenario.fleet("v1")) as stack:
        async with scenario.holding_the_slot(stack, "renamed"):
            waiters = [asyncio.create_task(ask(stack, "renamed")) for _ in range(2)]
            await scenario.waiting(stack, "renamed", 2)
            stack.fleet_file.write_text(yaml.safe_dump(scenario.fleet("v2")))
            await stack.control_plane_cli("config", "reload")

            async def renamed() -> bool:
                rows = await scenario.catalog(stack, "providers", "provider_id")
                return bool(rows["node-a-slow"]["models"] == ["v2"])

            await scenario.eventually(renamed)
        for status, text, took in await asyncio.gather(*waiters):
            print(f"served name changed: {status} in {took} s: {text}")
        async with scenario.holding_the_slot(stack, "b-only"):
            waiter = asyncio.create_task(ask(stack, "b-only"))
            await scenario.waiting(stack, "b-only", 1)
            retired = time.monotonic()
            await stack.control_plane_cli("node", "retire", "node-b")
            status, text, _ = await waiter
        after = time.monotonic() - retired
        print(f"node retired: {status} {after:.1f} s after `node retire` began: {text}")


if __name__ == "__main__":
    asyncio.run(main())
