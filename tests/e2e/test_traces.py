"""Traces (docs/ARCHITECTURE.md#traces) on a real stack, exported to a real OTLP receiver.

The receiver is Arize Phoenix (``make phoenix``: its own venv, ``.venv-phoenix``, since its
dependency tree pins versions .venv cannot take), started here on free ports; its REST
API lists the spans it ingested over OTLP/HTTP. The stack is conftest's: control-plane,
edge and two nodes as processes over mTLS, the mock provider as the engine stand-in.

Without Phoenix these tests skip, unless TEST_PHOENIX_REQUIRED=1 (``make test-traces``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

# Phoenix imports a large tree (pandas, pyarrow, GraphQL ...) before it listens: a minute
# or more on a busy 2-core machine, counted in the first test's time.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "mock-small"
STARTUP_S = 300  # its imports, then its database's migrations: generous on a busy machine


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 2,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 200,
    }


# One model on one node (node-b is there, as every stack's, with a model of its own).
FLEET: dict[str, object] = {
    "models": [
        {"id": MODEL, "providers": {"node-a-mock": "mock-served"}},
        {"id": "other", "providers": {"node-b-mock": "other-served"}},
    ],
    "nodes": [
        {"id": "node-a", "providers": [mock("node-a-mock", "mock-served")]},
        {"id": "node-b", "providers": [mock("node-b-mock", "other-served")]},
    ],
}


def _phoenix_command() -> str | None:
    """``PHOENIX_BIN`` (a ``phoenix`` executable), else ``make phoenix``'s (not an
    ``IOP_*`` name: the services would read it as a setting)."""
    named = os.environ.get("PHOENIX_BIN") or str(ROOT / ".venv-phoenix" / "bin" / "phoenix")
    return named if shutil.which(named) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Phoenix:
    """A running Phoenix server: ``traces_url`` takes OTLP/HTTP, ``spans`` reads back."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.traces_url = f"{self.base}/v1/traces"

    async def spans(self) -> list[dict[str, Any]]:
        """Every span of the default project (all these tests send there)."""
        found: list[dict[str, Any]] = []
        cursor = ""
        async with aiohttp.ClientSession() as http:
            while True:
                query = f"?limit=1000{'&cursor=' + cursor if cursor else ''}"
                async with http.get(f"{self.base}/v1/projects/default/spans{query}") as reply:
                    assert reply.status == 200, await reply.text()
                    page = await reply.json()
                found.extend(page["data"])
                cursor = page.get("next_cursor") or ""
                if not cursor:
                    return found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def phoenix(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Phoenix]:
    command = _phoenix_command()
    if command is None:
        if os.environ.get("TEST_PHOENIX_REQUIRED"):
            pytest.fail("no Phoenix: run `make phoenix` (TEST_PHOENIX_REQUIRED is set)")
        pytest.skip("no Phoenix (make phoenix installs it into .venv-phoenix)")
    work = tmp_path_factory.mktemp("phoenix")
    port = _free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(work),
        "PHOENIX_PORT": str(port),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_GRPC_PORT": str(_free_port()),
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = (work / "phoenix.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        command, "serve", env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work
    )
    server = Phoenix(port)
    try:
        deadline = time.monotonic() + STARTUP_S
        async with aiohttp.ClientSession() as http:
            while True:  # ready: its REST API answers (polled; it prints no port to wait on)
                assert process.returncode is None, (work / "phoenix.log").read_text()[-3000:]
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{server.base}/v1/projects") as reply:
                        if reply.status == 200:
                            break
                assert time.monotonic() < deadline, "Phoenix did not start in time"
                await asyncio.sleep(0.2)
        yield server
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()
        log.close()


async def _stream_chat(api_url: str) -> str:
    """One streamed chat request read to its end; returns its run id (X-Request-Id)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{api_url}/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            text = await response.text()
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            return response.headers["X-Request-Id"]


async def _run_record(api_url: str, run_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api_url[: -len('/v1')]}/iop/v1/runs?limit=50") as response:
            records = (await response.json())["data"]
    return next(r for r in records if r["run_id"] == run_id)


async def _trace_spans(
    phoenix: Phoenix, trace_id: str, ready: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """The trace's spans once ``ready`` says they are all in (the exporters send in
    batches, every few seconds): polled with a deadline."""
    deadline = time.monotonic() + 60
    while True:
        spans = [s for s in await phoenix.spans() if s["context"]["trace_id"] == trace_id]
        if ready(spans) or time.monotonic() > deadline:
            return spans
        await asyncio.sleep(0.5)


async def test_a_streamed_request_is_one_trace_of_edge_node_and_engine_spans(
    phoenix: Phoenix, start_stack_factory: Any, tmp_path: Path
) -> None:
    tracing = {"tracing": {"otlp_endpoint": phoenix.traces_url}}
    async with start_stack_factory(tmp_path, FLEET, tracing, node_settings=tracing) as stack:
        run_id = await _stream_chat(stack.api_url)
        record = await _run_record(stack.api_url, run_id)
        trace_id = record["trace_id"]
        assert len(trace_id) == 32, record
        assert int(trace_id, 16), record
        spans = await _trace_spans(phoenix, trace_id, lambda found: len(found) >= 3)

    assert len(spans) == 3, [s["name"] for s in spans]
    edge, node, engine = (s for s in sorted(spans, key=lambda s: s["start_time"]))
    for span in (edge, node, engine):  # the trace as Phoenix holds it (pytest -s shows it)
        print(span["name"], span["context"], span["parent_id"], span["attributes"])
    # one trace, each the child of the one before: edge -> node run -> engine call
    assert edge["name"] == f"chat {MODEL}"
    assert edge["parent_id"] is None
    assert node["name"].startswith("node chat ")
    assert node["parent_id"] == edge["context"]["span_id"]
    assert engine["name"].startswith("chat ")
    assert engine["parent_id"] == node["context"]["span_id"]
    a = edge["attributes"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.provider.name"] == "iop"
    assert a["iop.run_id"] == run_id
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] > 0
    assert a["gen_ai.server.time_to_first_token"] > 0
    assert node["attributes"]["iop.outcome"] == "completed"
    e = engine["attributes"]
    assert e["gen_ai.operation.name"] == "chat"
    assert e["gen_ai.provider.name"] == "mock"  # the engine's type
    assert e["gen_ai.request.model"] == e["gen_ai.response.model"]
    assert e["gen_ai.request.model"] == "mock-served"  # the node's served name
    assert e["gen_ai.usage.input_tokens"] == a["gen_ai.usage.input_tokens"]
    assert e["gen_ai.usage.output_tokens"] == a["gen_ai.usage.output_tokens"]
    assert e["gen_ai.server.time_to_first_token"] >= 0
    assert [ev["name"] for ev in engine["events"]] == ["gen_ai.first_token"]
    assert all(s["status_code"] != "ERROR" for s in spans)


async def test_with_tracing_off_no_span_is_made(
    phoenix: Phoenix, start_stack_factory: Any, tmp_path: Path
) -> None:
    """The edge's tracing off (the default), its nodes' on: no span at the edge, no
    traceparent to the node, so none there either; the run log's trace id is empty.
    Stopping the stack flushes every exporter, so what Phoenix has then is all there is."""
    node_tracing = {"tracing": {"otlp_endpoint": phoenix.traces_url}}
    before = {s["context"]["span_id"] for s in await phoenix.spans()}
    async with start_stack_factory(tmp_path, FLEET, node_settings=node_tracing) as stack:
        run_id = await _stream_chat(stack.api_url)
        assert (await _run_record(stack.api_url, run_id))["trace_id"] == ""
    new = [s for s in await phoenix.spans() if s["context"]["span_id"] not in before]
    assert new == []
