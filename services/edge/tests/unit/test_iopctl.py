"""``iopctl`` against a real HTTP server on 127.0.0.1 that serves canned catalog and runs.

The server is a few aiohttp handlers written here, shaped like the edge's documented
endpoints (``data`` lists, OpenAI error objects on 401), so each test states what
the edge said and checks what the operator saw. The live commands run in-process
as tasks (cancelled once their output is checked) and, for Ctrl-C, as the installed
console script receiving a real SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp import web

from iop_edge.cli.iopctl import CLEAR_SCREEN, run
from iop_proto.testing import refused_port

# Upper bound on waiting for an explicit signal (never a sleep); generous because a loaded
# machine may take seconds to start a Python process and import aiohttp.
WAIT = 30.0
KEY = "sk-iop-test"

Row = dict[str, Any]


def provider(provider_id: str, node_id: str, **fields: Any) -> Row:
    return {
        "provider_id": provider_id,
        "node_id": node_id,
        "type": "mock",
        "category": "local_inference",
        "health": "available",
        "connected": True,
        "capacity": 2,
        "in_flight": 0,
        "load_ratio": 0.0,
        "queued": 0,
        "models": ["served-name"],
        "serves": ["mock-small"],
        "lifecycle_capabilities": {"list_models": True, "load_model": False},
        "detail": "",
        **fields,
    }


def record(run_id: str, received_ms: int, **fields: Any) -> Row:
    return {
        "run_id": run_id,
        "model": "mock-small",
        "provider_id": "node-a-mock",
        "node_id": "node-a",
        "operation": "chat.completions",
        "stream": True,
        "outcome": "completed",
        "status": 200,
        "error_code": "",
        "received_ms": received_ms,
        "queue_wait_ms": 3,
        "ttft_ms": 120,
        "duration_ms": 1500,
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "cached_tokens": 4,
        **fields,
    }


@dataclass
class Canned:
    """What the fake edge answers; tests change it while a live command runs."""

    url: str = ""
    key: str = ""  # "" = the API is open
    providers: list[Row] = field(default_factory=list)
    models: list[Row] = field(default_factory=list)
    runs: list[Row] = field(default_factory=list)  # newest first, as the edge answers
    run_limits: list[int] = field(default_factory=list)
    auth_seen: list[str] = field(default_factory=list)
    run_polled: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for_run_polls(self, count: int) -> None:
        async with asyncio.timeout(WAIT):
            while len(self.run_limits) < count:
                self.run_polled.clear()
                await self.run_polled.wait()


ATTEMPTS: Final = [  # run-1 failed over: node-b-mock refused it, node-a-mock answered
    {"run_id": "run-1", "provider_id": "node-b-mock", "node_id": "node-b", "outcome": "failed",
     "error_code": "provider_unavailable", "started_ms": 1_700_000_001_001, "duration_ms": 2},
    {"run_id": "run-1b", "provider_id": "node-a-mock", "node_id": "node-a",
     "outcome": "completed", "error_code": "", "started_ms": 1_700_000_001_003,
     "duration_ms": 2490},
]  # fmt: skip


def canned_data() -> Canned:
    return Canned(
        providers=[
            provider(
                "node-a-mock",
                "node-a",
                in_flight=1,
                load_ratio=0.5,
                cache={"hit_rate": 0.4567, "prompt_tokens": 1000, "cached_tokens": 457},
            ),
            provider(
                "node-b-mock",
                "node-b",
                health="unavailable",
                connected=False,
                queued=3,
                serves=["mock-small", "solo"],
            ),
        ],
        models=[
            {
                "id": "mock-small",
                "display_name": "Mock (small)",
                "providers": {"node-a-mock": "served-name", "node-b-mock": "served-b"},
                "available_providers": ["node-a-mock"],
                "queued": 2,
            },
            {
                "id": "solo",
                "display_name": "",
                "providers": {"node-b-mock": "solo"},
                "available_providers": [],
                "queued": 0,
            },
        ],
        runs=[
            record("run-2", 1_700_000_002_000, outcome="failed", status=503, error_code="x_err"),
            record("run-1", 1_700_000_001_000, ttft_ms=0, duration_ms=2500, attempts=ATTEMPTS),
        ],
    )


@contextlib.asynccontextmanager
async def fake_edge(canned: Canned) -> AsyncIterator[Canned]:
    def authorized(request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        canned.auth_seen.append(header)
        return not canned.key or header == f"Bearer {canned.key}"

    def unauthorized() -> web.Response:
        error = {"message": "Incorrect API key provided.", "type": "invalid_request_error"}
        return web.json_response({"error": error}, status=401)

    async def providers(request: web.Request) -> web.Response:
        if not authorized(request):
            return unauthorized()
        return web.json_response({"data": canned.providers})

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return unauthorized()
        return web.json_response({"data": canned.models})

    async def runs(request: web.Request) -> web.Response:
        if not authorized(request):
            return unauthorized()
        limit = int(request.query["limit"])
        canned.run_limits.append(limit)
        canned.run_polled.set()
        return web.json_response({"data": canned.runs[:limit]})

    app = web.Application()
    app.router.add_get("/iop/v1/catalog/providers", providers)
    app.router.add_get("/iop/v1/catalog/models", models)
    app.router.add_get("/iop/v1/runs", runs)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        canned.url = f"http://{host}:{port}"
        yield canned
    finally:
        await runner.cleanup()


@pytest.fixture
async def edge() -> AsyncIterator[Canned]:
    async with fake_edge(canned_data()) as canned:
        yield canned


class Output(io.StringIO):
    """A captured stream that wakes waiters on every write (a live command's readiness)."""

    def __init__(self) -> None:
        super().__init__()
        self._written = asyncio.Event()

    def write(self, text: str) -> int:
        self._written.set()
        return super().write(text)

    async def wait_for(self, text: str, count: int = 1) -> None:
        async with asyncio.timeout(WAIT):
            while self.getvalue().count(text) < count:
                self._written.clear()
                await self._written.wait()


async def iopctl(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = await run(list(argv), out, err)
    return status, out.getvalue(), err.getvalue()


def cells(line: str) -> list[str]:
    return line.split()


# ---------------------------------------------------------------- one-shot commands


async def test_providers_table(edge: Canned) -> None:
    status, out, err = await iopctl("providers", "--url", edge.url)
    assert (status, err) == (0, "")
    header, first, second = out.splitlines()
    assert cells(header) == [
        "PROVIDER", "NODE", "TYPE", "HEALTH", "IN_FLIGHT/CAP", "LOAD", "QUEUED", "CACHE_HIT",
        "WARM", "MODELS",
    ]  # fmt: skip
    assert cells(first) == ["node-a-mock", "node-a", "mock", "available", "1/2", "50%", "0",
                            "46%", "-", "mock-small"]  # fmt: skip
    # nothing reported yet (or an edge from before the cache was reported): "-"
    assert cells(second) == ["node-b-mock", "node-b", "mock", "unavailable", "0/2", "0%", "3",
                             "-", "-", "mock-small,solo"]  # fmt: skip
    # Aligned columns: every row's NODE starts where the header's does.
    assert {line.index("node-") for line in (first, second)} == {0}
    assert {line.index(" node-", 1) for line in (first, second)} == {header.index(" NODE")}


async def test_the_health_column_shows_the_edges_ejection_beside_the_nodes_word(
    edge: Canned,
) -> None:
    edge.providers[0]["outlier_state"] = "ejected"
    edge.providers[1]["outlier_state"] = "half_open"
    _, out, _ = await iopctl("providers", "--url", edge.url)
    _, first, second = out.splitlines()
    assert cells(first)[3:5] == ["available", "(ejected)"]
    assert cells(second)[3:6] == ["unavailable", "(on", "trial)"]


async def test_a_held_provider_shows_its_capacity_and_state_not_0_of_0(edge: Canned) -> None:
    # What the catalog says of a drained and a disabled provider: capacity 0 (selection's
    # truth), load 1.0; the capacity it serves with once enabled in control.held_capacity.
    held = {"capacity": 0, "load_ratio": 1.0, "in_flight": 0}
    edge.providers[0].update(held, control={"state": "drained", "held_capacity": 2})
    edge.providers[1].update(held, control={"state": "disabled", "held_capacity": 3})
    _, out, _ = await iopctl("providers", "--url", edge.url)
    _, first, second = out.splitlines()
    assert cells(first)[3:7] == ["available", "(drained)", "0/2", "drained"]
    assert cells(second)[3:7] == ["unavailable", "(disabled)", "0/3", "disabled"]
    assert "0/0" not in out
    assert "100%" not in out


async def test_the_warm_column_shows_each_model_warm_or_cold_with_its_last_load(
    edge: Canned,
) -> None:
    models = [
        {"name": "llama3", "warm": True, "last_load_ms": 2140},
        {"name": "qwen3", "warm": False, "last_load_ms": None},
    ]
    edge.providers[0]["warmth"] = {"on_demand": True, "max_loaded": 1, "models": models}
    edge.providers[1]["warmth"] = {"on_demand": False, "max_loaded": 0, "models": []}
    edge.models[0]["warm_providers"] = ["node-a-mock"]
    _, out, _ = await iopctl("providers", "--url", edge.url)
    header, first, second = out.splitlines()
    warm = cells(header).index("WARM")
    assert cells(first)[warm] == "llama3:warm(2.14s),qwen3:cold"
    assert cells(second)[warm] == "always"  # vLLM, llama.cpp: every model, always
    _, out, _ = await iopctl("models", "--url", edge.url)
    assert cells(out.splitlines()[1]) == ["mock-small", "Mock", "(small)", "1/2", "1", "2"]


async def test_models_table(edge: Canned) -> None:
    status, out, _ = await iopctl("models", "--url", edge.url)
    assert status == 0
    lines = out.splitlines()
    assert cells(lines[0]) == ["ID", "NAME", "AVAILABLE/PROVIDERS", "WARM", "QUEUED"]
    assert cells(lines[1]) == ["mock-small", "Mock", "(small)", "1/2", "-", "2"]
    assert cells(lines[2]) == ["solo", "solo", "0/1", "-", "0"]  # no display name: the id


async def test_runs_table_reads_oldest_first_and_passes_the_limit(edge: Canned) -> None:
    status, out, _ = await iopctl("runs", "--url", edge.url, "--limit", "5")
    assert status == 0
    assert edge.run_limits == [5]
    header, older, newer = out.splitlines()
    assert cells(header) == [
        "RECEIVED", "RUN", "MODEL", "PROVIDER", "WAIT", "TTFT", "DURATION", "TOKENS", "CACHED",
        "OUTCOME",
    ]  # fmt: skip
    assert cells(older)[1:] == ["run-1", "mock-small", "node-a-mock", "3ms", "-", "2.50s", "5/7",
                                "4", "completed", "200", "after", "node-b-mock",
                                "provider_unavailable"]  # fmt: skip
    assert cells(newer)[1:] == ["run-2", "mock-small", "node-a-mock", "3ms", "120ms", "1.50s",
                                "5/7", "4", "failed", "503", "x_err"]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "kind"), [("providers", "providers"), ("models", "models"), ("runs", "runs")]
)
async def test_json_is_the_endpoints_data(edge: Canned, command: str, kind: str) -> None:
    # --json is accepted after the command and before it.
    for argv in ([command, "--json", "--url", edge.url], ["--json", "--url", edge.url, command]):
        status, out, _ = await iopctl(*argv)
        assert status == 0
        assert json.loads(out) == getattr(edge, kind)


async def test_the_openai_base_url_and_the_environment_work_too(
    edge: Canned, monkeypatch: pytest.MonkeyPatch
) -> None:
    status, out, _ = await iopctl("models", "--json", "--url", f"{edge.url}/v1/")
    assert (status, json.loads(out)) == (0, edge.models)
    edge.key = KEY
    monkeypatch.setenv("IOP_EDGE_URL", edge.url)
    monkeypatch.setenv("IOP_API_KEY", KEY)
    status, out, _ = await iopctl("models", "--json")
    assert (status, json.loads(out)) == (0, edge.models)


# ---------------------------------------------------------------- errors


async def test_401_is_one_line_on_stderr_and_exit_1(edge: Canned) -> None:
    edge.key = KEY
    status, out, err = await iopctl("providers", "--url", edge.url)
    assert (status, out) == (1, "")
    assert err.count("\n") == 1
    assert "API key required" in err
    assert "Incorrect API key provided." in err  # the edge's own words
    status, out, err = await iopctl("providers", "--url", edge.url, "--key", "wrong")
    assert (status, out) == (1, "")
    assert "API key required" in err

    status, out, err = await iopctl("providers", "--url", edge.url, "--key", KEY)
    assert (status, err) == (0, "")
    assert edge.auth_seen[-1] == f"Bearer {KEY}"


async def test_connection_refused_is_one_line_and_exit_1() -> None:
    with refused_port() as port:
        status, out, err = await iopctl("models", "--url", f"http://127.0.0.1:{port}")
    assert (status, out) == (1, "")
    assert err.startswith(f"iopctl: cannot reach the edge at http://127.0.0.1:{port}")
    assert err.count("\n") == 1


async def test_a_live_command_stops_on_401(edge: Canned) -> None:
    out, err = Output(), io.StringIO()
    task = asyncio.create_task(run(["watch", "--url", edge.url, "--interval", "0.05"], out, err))
    await out.wait_for("node-a-mock")
    edge.key = KEY  # the key was revoked: retrying cannot help
    async with asyncio.timeout(WAIT):
        assert await task == 1
    assert "API key required" in err.getvalue()


# ---------------------------------------------------------------- live commands


async def test_runs_tail_prints_each_new_run_once(edge: Canned) -> None:
    out, err = Output(), io.StringIO()
    argv = ["runs", "--tail", "--url", edge.url, "--interval", "0.05"]
    task = asyncio.create_task(run(argv, out, err))
    try:
        await out.wait_for("run-2")
        edge.runs.insert(0, record("run-3", 1_700_000_003_000, completion_tokens=11))
        await out.wait_for("run-3")
        edge.runs.insert(0, record("run-4", 1_700_000_004_000))
        await out.wait_for("run-4")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    lines = out.getvalue().splitlines()
    assert cells(lines[0])[:3] == ["RECEIVED", "RUN", "MODEL"]  # one header, at the top
    assert [cells(line)[1] for line in lines[1:]] == ["run-1", "run-2", "run-3", "run-4"]
    assert "5/11" in lines[3]
    assert err.getvalue() == ""


async def test_runs_tail_starts_with_the_newest_limit_and_never_reprints(edge: Canned) -> None:
    edge.runs = [record(f"old-{n}", 1_700_000_000_000 + n) for n in range(30, 0, -1)]
    out = Output()
    argv = ["runs", "--tail", "--limit", "3", "--url", edge.url, "--interval", "0.05"]
    task = asyncio.create_task(run(argv, out, io.StringIO()))
    try:
        await out.wait_for("old-30")
        edge.runs.insert(0, record("new-1", 1_700_000_100_000))
        await out.wait_for("new-1")
        # A run received before others but finished after them still shows, once.
        edge.runs.insert(3, record("late", 1_700_000_000_029))
        await out.wait_for("late")
        # Two more polls answered: whatever the first of them held has been printed.
        await edge.wait_for_run_polls(len(edge.run_limits) + 2)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [cells(line)[1] for line in out.getvalue().splitlines()[1:]] == [
        "old-28", "old-29", "old-30", "new-1", "late",
    ]  # fmt: skip
    assert set(edge.run_limits) == {200}  # a window wider than what is printed


async def test_runs_tail_json_is_one_run_per_line(edge: Canned) -> None:
    out = Output()
    argv = ["runs", "--tail", "--json", "--url", edge.url, "--interval", "0.05"]
    task = asyncio.create_task(run(argv, out, io.StringIO()))
    try:
        await out.wait_for("\n", count=2)
        edge.runs.insert(0, record("run-3", 1_700_000_003_000))
        await out.wait_for("\n", count=3)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [json.loads(line) for line in out.getvalue().splitlines()] == edge.runs[::-1]


async def test_watch_redraws_in_place(edge: Canned) -> None:
    out = Output()
    task = asyncio.create_task(
        run(["watch", "--url", edge.url, "--interval", "0.05"], out, io.StringIO())
    )
    try:
        await out.wait_for(CLEAR_SCREEN)
        edge.providers[0]["in_flight"] = 2
        await out.wait_for("2/2")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    last = out.getvalue().rpartition(CLEAR_SCREEN)[2]
    assert "iopctl watch" in last
    assert "PROVIDER" in last
    assert "AVAILABLE/PROVIDERS" in last


async def test_watch_keeps_going_while_the_edge_is_away() -> None:
    out, err = Output(), io.StringIO()
    async with fake_edge(canned_data()) as first:
        argv = ["watch", "--url", first.url, "--interval", "0.05"]
        task = asyncio.create_task(run(argv, out, err))
        await out.wait_for("node-a-mock")
    try:
        await out.wait_for("cannot reach the edge")  # shown on screen; still running
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# ---------------------------------------------------------------- Ctrl-C, for real


def _sigint_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT's default disposition, whatever this process's is."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("argv", "ready"),
    [(["runs", "--tail"], b"run-2"), (["watch"], b"node-b-mock")],
)
async def test_ctrl_c_ends_a_live_command_with_status_0(
    edge: Canned, argv: list[str], ready: bytes
) -> None:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iopctl"),
        *argv,
        "--url",
        edge.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "IOP_API_KEY": ""},
        # What Ctrl-C does is the terminal's default: a shell that started this run with SIGINT
        # ignored (a background job, nohup, some CI runners) would hand that on to the child.
        preexec_fn=_sigint_as_at_a_terminal,
    )
    assert process.stdout is not None
    try:
        seen = b""
        async with asyncio.timeout(WAIT * 2):
            while ready not in seen:
                chunk = await process.stdout.read(4096)
                assert chunk, "iopctl exited before printing"
                seen += chunk
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(WAIT):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr
