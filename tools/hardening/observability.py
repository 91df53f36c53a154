"""Issue 33, dashboards and alerts: what of them a stack feeds, on the checkout the venv
imports (``PYTHONPATH`` of another checkout's ``src`` folders measures that one, its services
included: they inherit it): the same script before and after.

A real stack (tests/conftest.py's ``start_stack``), one streamed request through it, then
each service's ``/metrics``. Printed: the certificate expiry series of each service, and the
metric names that this repository's dashboards and alert rules read, with how many of them
the stack exposes (a name missing is a panel or a rule with nothing to show).

    PYTHONPATH=CHECKOUT/proto/src:CHECKOUT/services/edge/src:... \\
        .venv/bin/python tools/hardening/observability.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\b(iop_[a-z0-9_]+)\b")


def _conftest() -> Any:
    spec = importlib.util.spec_from_file_location("stack_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["stack_conftest"] = module
    spec.loader.exec_module(module)
    return module


def read_names() -> set[str]:
    """The metric names the dashboards and the alert rules read."""
    exprs = [
        target["expr"]
        for path in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")
        for panel in json.loads(path.read_text())["panels"]
        for target in panel["targets"]
    ]
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    return {name for expr in exprs for name in METRIC.findall(expr)}


def exposed(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


async def measure() -> None:
    conftest = _conftest()
    with tempfile.TemporaryDirectory() as root:
        async with conftest.start_stack(Path(root), conftest.FLEET) as stack:
            body = {
                "model": "mock-small",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{stack.api_url}/chat/completions", json=body) as answer:
                    await answer.read()
                seen: set[str] = set()
                for name, service in sorted(stack.services.items()):
                    async with http.get(f"{service.admin_url}/metrics") as response:
                        text = await response.text()
                    seen |= exposed(text)
                    certs = [
                        line
                        for line in text.splitlines()
                        if line.startswith("iop_certificate_expiry")
                    ]
                    print(f"{name}: {len(certs)} certificate expiry series")
    wanted = read_names()
    missing = sorted(wanted - seen)  # both hold exposition names (_total, _bucket: as read)
    print(f"metrics read by dashboards and rules: {len(wanted)}", end="; ")
    print(f"exposed by the stack: {len(wanted) - len(missing)}")
    print(f"not exposed: {', '.join(missing) or 'none'}")


def main() -> None:
    asyncio.run(measure())


if __name__ == "__main__":
    main()
