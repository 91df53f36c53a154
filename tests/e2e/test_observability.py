"""The dashboards and alert rules of deploy/ against a real Prometheus scraping a real stack.

Debian's ``prometheus`` (the binary, not its systemd unit) scrapes every service's
``/metrics`` each second and evaluates deploy/prometheus/alerts.yml each second, their
``for:`` shortened to a few seconds (the expressions are the file's own). After traffic
through every part the dashboards show (a key, a stream, an error, a batch through the
worker), each query of deploy/grafana/dashboards/*.json returns data, each variable has
values, each rule evaluates with every metric it reads present,
and IopProviderDown fires once a node is stopped (docs/observability.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from iop_proto.testing import PortTaken, port_taken, ports_to_try

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="needs Debian's prometheus (.ci/run installs it)"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
JOBS = {
    "control-plane": "iop-control-plane",
    "edge": "iop-edge",
    "node-a": "iop-node",
    "node-b": "iop-node",
    "worker": "iop-worker",
}
# Metrics the rules and dashboards read that a stack shows only once configured so: keys and
# node tokens with an expiry date (the control-plane's gauge; none expires in this stack).
# A query of them is checked like the others as soon as Prometheus holds a series of them.
OPTIONAL = {"iop_credential_expiry_timestamp_seconds"}
METRIC = re.compile(r"\b(iop_[a-z0-9_]+|up)\b")
WAIT_S = 90.0  # generous: a busy machine; Prometheus scrapes and evaluates each second
Stack = Any


class Prometheus:
    def __init__(self, url: str, process: asyncio.subprocess.Process) -> None:
        self.url = url
        self.process = process

    async def api(self, path: str, **params: str) -> Any:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{self.url}/api/v1/{path}", params=params) as response:
                body = await response.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.api("query", query=expr)
        return list(data["result"])

    async def has_series(self, metric: str) -> bool:
        return bool(await self.query(f"count({metric})"))


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel, PromQL) of every target, variables replaced as Grafana would."""
    found = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m")
                expr = re.sub(r"\$(model|provider|key)\b", ".*", expr)
                found.append((path.name, panel["title"], expr))
    return found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prometheus(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Prometheus]:
    root = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "3s"
    (root / "alerts.yml").write_text(yaml.safe_dump(rules))
    scrape = [
        {
            "job_name": job,
            "static_configs": [
                {"targets": [stack.services[name].admin_url.removeprefix("http://")]}
                for name, role in JOBS.items()
                if role == job
            ],
        }
        for job in sorted(set(JOBS.values()))
    ]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(root / "alerts.yml")],
        "scrape_configs": scrape,
    }
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (root / "prometheus.log").open("ab")  # what it said, for a failure's reader
    for port in ports_to_try():
        process = await asyncio.create_subprocess_exec(
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await _ready(url, process, port)
        except PortTaken:
            continue
        break
    try:
        yield Prometheus(url, process)
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 30)
        log.close()


async def _ready(url: str, process: asyncio.subprocess.Process, port: int) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(WAIT_S):
        while True:
            if process.returncode is not None:
                if port_taken(port):
                    raise PortTaken(str(port))
                raise AssertionError(f"prometheus exited with {process.returncode}")
            try:
                async with http.get(f"{url}/-/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)  # another process starting: no event to wait on


async def _traffic(stack: Stack) -> None:
    """A key's requests through two APIs (one streamed), an error, and a batch."""
    secret = await stack.issue_key("dash-observer")
    async with AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0) as sdk:
        await _requests(sdk)


async def _requests(sdk: AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
    for model in ("mock-small", "solo"):
        await sdk.chat.completions.create(model=model, messages=messages)
        stream = await sdk.chat.completions.create(model=model, messages=messages, stream=True)
        async for _ in stream:
            pass
    await sdk.completions.create(model="mock-small", prompt="hi")
    with pytest.raises(Exception, match=r"404|not found"):
        await sdk.chat.completions.create(model="no-such-model", messages=messages)
    line = {"method": "POST", "url": "/v1/chat/completions"}
    content = "".join(
        json.dumps(
            {**line, "custom_id": f"l{n}", "body": {"model": "mock-small", "messages": messages}}
        )
        + "\n"
        for n in range(2)
    )
    upload = await sdk.files.create(file=("lines.jsonl", content.encode()), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    async with asyncio.timeout(WAIT_S):
        while batch.status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing"), batch
            await asyncio.sleep(0.2)  # the worker is another process
            batch = await sdk.batches.retrieve(batch.id)


async def test_every_dashboard_query_returns_data(stack: Stack, prometheus: Prometheus) -> None:
    await _traffic(stack)
    queries = dashboard_queries()
    assert len(queries) > 30
    async with asyncio.timeout(WAIT_S):  # until the scrapes after the traffic hold all of it
        while True:
            empty = []
            for dashboard, title, expr in queries:
                optional = set(METRIC.findall(expr)) & OPTIONAL
                if await prometheus.query(expr):
                    continue
                # a query of a metric this stack does not show (OPTIONAL) may be empty
                if not optional or any([await prometheus.has_series(m) for m in optional]):
                    empty.append(f"{dashboard} / {title}: {expr}")
            if not empty:
                break
            await asyncio.sleep(1)  # the next scrape is a second away
    # every variable a dashboard offers has values to pick
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            found = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"])
            assert found is not None, variable
            values = await prometheus.api(
                f"label/{found.group(2)}/values", **{"match[]": found.group(1)}
            )
            assert values, (path.name, variable["name"])
    # the key's usage is there under its own key label, the certificates of every service
    keys = await prometheus.query('sum by (key) (iop_edge_tokens_total{key!=""})')
    assert keys, "no tokens under the key's id"
    assert float(keys[0]["value"][1]) > 0
    certs = await prometheus.query("count by (job) (iop_certificate_expiry_timestamp_seconds)")
    assert {row["metric"]["job"] for row in certs} == set(JOBS.values())


async def test_every_rule_evaluates_on_present_metrics(prometheus: Prometheus) -> None:
    names = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    async with asyncio.timeout(WAIT_S):
        while True:
            groups = (await prometheus.api("rules"))["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            if {r["name"] for r in rules} == names and all(r["health"] == "ok" for r in rules):
                break
            await asyncio.sleep(0.5)  # evaluated each second
    missing = []
    for rule in rules:
        for metric in set(METRIC.findall(rule["query"])) - OPTIONAL:
            if not await prometheus.has_series(metric):
                missing.append(f"{rule['name']}: {metric}")
    assert not missing


async def test_provider_down_fires_when_a_node_stops(stack: Stack, prometheus: Prometheus) -> None:
    async def firing() -> set[str]:
        alerts = (await prometheus.api("alerts"))["alerts"]
        return {
            a["labels"]["provider"]
            for a in alerts
            if a["labels"]["alertname"] == "IopProviderDown" and a["state"] == "firing"
        }

    assert "node-b-mock" not in await firing()
    await stack.stop("node-b")
    async with asyncio.timeout(WAIT_S):
        while "node-b-mock" not in await firing():  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.5)  # evaluated each second, firing after its 3 s `for:`
    assert "node-a-mock" not in await firing()
