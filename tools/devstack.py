"""Run the whole IOP stack as local processes in the foreground: the program behind ``make run``.

One parent owns every child so that Ctrl-C is all it takes to stop the stack and
nothing is left running: children live in their own process groups (a terminal's
Ctrl-C reaches only us), and we stop them in reverse start order, then clean up
whatever they left in their groups. Services start one at a time, each only once
the previous one says it is ready, because later services connect to earlier ones.

Every line a child writes is prefixed with its name, like ``docker compose`` or
foreman, so the interleaved logs stay readable. The processes are declared in
``SERVICES``; adding one is adding an entry. The first is not an IOP service but
node-a's provider, a real llama.cpp server (``tools/llama_server.py``).

"Up" means usable, not merely started: after every process is ready we wait until
the edge's catalog shows every provider of the fleet available, then print one
``IOP is up`` line. From then on we supervise: a service that exits is logged and
started again, after a delay that doubles while it keeps dying quickly, and the
others keep running, so the dev stack can show a pool that survives a lost node. A
service that fails while the stack comes up still stops everything: that is a setup
problem, which restarting would only hide. Ctrl-C still stops everything.

With ``--port-offset`` the control-plane is given a copy of the fleet file whose
local endpoints are shifted too, so node-a dials the shifted llama.cpp port.

With ``--vllm`` (``make run VLLM=1``) a real vLLM (``tools/vllm_server.py``, from
``make vllm``) starts after llama.cpp, and the control-plane reads
``configs/fleet-vllm.yaml``: ``smollm2:135m`` served by llama.cpp on node-a and by vLLM
on node-b, each under its own name, one public model id.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One process of the stack; its place in ``SERVICES`` is its start order."""

    name: str
    script: str  # console script in --bin; with ``argv``, a program file under the repository
    config: str | None  # settings file, relative to the repository root; None: it has none
    admin_port: int  # its readiness port (admin HTTP for IOP services), before --port-offset
    tls: bool = True  # gets the certificate files named after ``name`` from --certs
    health_path: str = "/healthz"
    # Further listening ports: settings override (env name) -> port before --port-offset.
    ports: Mapping[str, int] = field(default_factory=dict)
    # State files: settings override (env name) -> file name under the state directory.
    state: Mapping[str, str] = field(default_factory=dict)
    # Ports of earlier services this one dials: env name -> base port (shifted too).
    dials: Mapping[str, int] = field(default_factory=dict)
    # A program that is not an IOP console script: its command line, each part formatted
    # with {python} (this interpreter), {script} (``script`` made absolute), {host} and
    # {port} (``admin_port`` shifted). Empty: ``<--bin>/<script> --config <config>``.
    argv: tuple[str, ...] = ()
    port_role: str = "admin"  # what ``admin_port`` serves, for messages
    ready_timeout_s: float | None = None  # its own bound on start-up; None: --ready-timeout

    def all_ports(self) -> dict[str, int]:
        """Every port this service listens on, keyed by what it is for."""
        return {f"{self.port_role} port": self.admin_port} | {
            f"{env.removeprefix('IOP_').lower().replace('__', '.')}": port
            for env, port in self.ports.items()
        }


SERVICES: tuple[ServiceSpec, ...] = (
    # node-a's provider (configs/fleet.yaml: node-a-llamacpp at 127.0.0.1:8091), so it
    # starts first and stops last. One thread: a 2-core machine runs the stack beside it.
    ServiceSpec(
        "llamacpp",
        "tools/llama_server.py",
        None,
        8091,
        tls=False,
        health_path="/health",
        argv=(
            "{python}",
            "{script}",
            *("--host", "{host}", "--port", "{port}", "--threads", "1"),
            *("--ctx", "8192", "--parallel", "1", "--alias", "smollm2:135m"),
        ),
        port_role="API",
    ),
    ServiceSpec(
        "control-plane",
        "iop-control-plane",
        "configs/dev/control-plane.yaml",
        9100,
        ports={"IOP_LISTEN__PORT": 7100},
        state={"IOP_DATABASE": "control-plane.db", "IOP_PID_FILE": "control-plane.server.pid"},
    ),
    ServiceSpec(
        "edge",
        "iop-edge",
        "configs/dev/edge.yaml",
        9101,
        ports={"IOP_HTTP__PORT": 8080, "IOP_NODE_LISTENER__PORT": 7000},
        state={
            "IOP_CONFIG_CACHE": "edge-fleet-config.pb",
            "IOP_HISTORY_DB": "edge-runs.db",
            "IOP_BATCH_DB": "edge-batches.db",
            "IOP_RESPONSES_DB": "edge-responses.db",
        },
        dials={"IOP_CONTROL_PLANE__PORT": 7100},
    ),
    ServiceSpec(
        "node-a",
        "iop-node",
        "configs/dev/node-a.yaml",
        9102,
        state={"IOP_TOKEN_FILE": "node-a.token", "IOP_HISTORY_DB": "node-a-history.db"},
        dials={"IOP_EDGE__PORT": 7000},
    ),
    ServiceSpec(
        "node-b",
        "iop-node",
        "configs/dev/node-b.yaml",
        9103,
        state={"IOP_TOKEN_FILE": "node-b.token", "IOP_HISTORY_DB": "node-b-history.db"},
        dials={"IOP_EDGE__PORT": 7000},
    ),
    ServiceSpec(
        "worker",
        "iop-worker",
        "configs/dev/worker.yaml",
        9104,
        dials={"IOP_EDGE__PORT": 7000},  # workers dial the edge's node listener
    ),
)

# node-b's second provider with --vllm (configs/fleet-vllm.yaml: node-b-vllm at
# 127.0.0.1:8092), started right after llama.cpp. vLLM takes 45-50 s to start on 2 cores
# (more beside other work): it has a start-up bound of its own.
VLLM_SERVICE = ServiceSpec(
    "vllm",
    "tools/vllm_server.py",
    None,
    8092,
    tls=False,
    health_path="/health",
    argv=(
        "{python}",
        "{script}",
        *("--host", "{host}", "--port", "{port}", "--served-model-name", "smollm2-135m-vllm"),
        *("--max-model-len", "1024", "--max-num-seqs", "4", "--stop-timeout", "8"),
    ),
    port_role="API",
    ready_timeout_s=300.0,
)
VLLM_FLEET = REPO / "configs" / "fleet-vllm.yaml"
VLLM_MODEL = "var/vllm/smollm2-135m-instruct"  # what `make vllm` converts (the launcher's default)


def services(vllm: bool) -> tuple[ServiceSpec, ...]:
    """The stack's processes in start order; with vLLM, it comes right after llama.cpp."""
    return (*SERVICES[:1], VLLM_SERVICE, *SERVICES[1:]) if vllm else SERVICES


SELF = "devstack"
CONTROL_PLANE = "iop-control-plane"
FLEET_ENV = "IOP_FLEET_FILE"  # the control-plane's fleet_file setting
FLEET_COPY = "fleet.yaml"  # under --state-dir, written only with a port offset
API_PORT_ENV = "IOP_HTTP__PORT"  # the edge's OpenAI API port
AVAILABLE = "available"
READY_TIMEOUT_S = 30.0
PROVIDERS_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.1
DRAIN_TIMEOUT_S = 2.0
RESTART_FIRST_S = 0.5  # delay before restarting a service that exited
RESTART_MAX_S = 10.0  # the longest delay, however often it exits
RESTART_STABLE_S = 30.0  # up this long, its next exit starts again from RESTART_FIRST_S
LINE_LIMIT = 1 << 20
# What a service logs once it serves: iop_proto.service.runner's "ready: edge admin
# http://..." for the IOP services, tools/llama_server.py's "ready: llamacpp http://...".
READY_LINE = re.compile(r"\bready: \S+ (?:admin )?http://\S+")
EXIT_OK, EXIT_FAILED, EXIT_PREFLIGHT = 0, 1, 2
COLORS = ("36", "33", "32", "35", "34", "91", "92", "93", "94", "95")


@dataclass(frozen=True, slots=True)
class Options:
    port_offset: int
    certs: Path
    bin_dir: Path
    run_dir: Path
    state_dir: Path
    ready_timeout: float
    stop_timeout: float
    providers_timeout: float
    fleet: Path | None = None  # the fleet file instead of the dev control-plane's (--vllm)


@dataclass(frozen=True, slots=True)
class Plan:
    """A service resolved against the options: exactly what will run, and where."""

    spec: ServiceSpec
    port: int
    program: Path  # the executable (console script) or program file that must exist
    config: Path | None
    argv: tuple[str, ...]
    env: Mapping[str, str]
    pid_file: Path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def cert_files(certs: Path, name: str) -> dict[str, Path]:
    """The settings keys a certificate directory fills in, as ``tools/devcerts.py`` names them."""
    return {
        "CA_FILE": certs / "ca.pem",
        "CERT_FILE": certs / f"{name}.pem",
        "KEY_FILE": certs / f"{name}.key",
    }


def child_env(spec: ServiceSpec, opts: Options) -> dict[str, str]:
    """Our environment plus overrides, so the dev settings files never need editing."""
    certs = opts.certs
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # lines should reach us as they are written
    if spec.config is not None:  # IOP settings overrides; other programs get argv instead
        env["IOP_ADMIN__HOST"] = HOST  # the address whose ports the preflight checked
        env["IOP_ADMIN__PORT"] = str(spec.admin_port + opts.port_offset)
    if spec.script == CONTROL_PLANE and opts.port_offset:
        env[FLEET_ENV] = str(opts.state_dir / FLEET_COPY)  # see write_fleet()
    elif spec.script == CONTROL_PLANE and opts.fleet is not None:
        env[FLEET_ENV] = str(opts.fleet)
    for name, port in {**spec.ports, **spec.dials}.items():
        env[name] = str(port + opts.port_offset)
    for name, file_name in spec.state.items():
        env[name] = str(opts.state_dir / file_name)
    if spec.tls:
        for key, path in cert_files(certs, spec.name).items():
            env[f"IOP_TLS__{key}"] = str(path)
    return env


def make_plan(spec: ServiceSpec, opts: Options) -> Plan:
    port = spec.admin_port + opts.port_offset
    config = None if spec.config is None else REPO / spec.config
    if spec.argv:
        program = REPO / spec.script
        fields = {"python": sys.executable, "script": program, "host": HOST, "port": port}
        argv = tuple(part.format(**fields) for part in spec.argv)
    else:
        program = opts.bin_dir / spec.script
        argv = (str(program), "--config", str(config))
    return Plan(
        spec=spec,
        port=port,
        program=program,
        config=config,
        argv=argv,
        env=child_env(spec, opts),
        pid_file=opts.run_dir / f"{spec.name}.pid",
    )


def control_plane(plans: Sequence[Plan]) -> Plan:
    return next(plan for plan in plans if plan.spec.script == CONTROL_PLANE)


def api_root(plans: Sequence[Plan], opts: Options) -> str:
    """Where the edge serves the OpenAI API and the catalog."""
    port = next(p.spec.ports[API_PORT_ENV] for p in plans if API_PORT_ENV in p.spec.ports)
    return f"http://{HOST}:{port + opts.port_offset}"


# --- the fleet: what the control-plane serves, and which providers "up" waits for ---------

# A provider endpoint on this machine: `endpoint: http://127.0.0.1:8091` (quotes optional).
LOCAL_ENDPOINT = re.compile(
    r"""^(?P<head>\s*-?\s*endpoint:\s*["']?https?://(?:127\.0\.0\.1|localhost):)(?P<port>\d+)""",
    re.MULTILINE,
)


def fleet_source(plans: Sequence[Plan], fleet: Path | None = None) -> Path:
    """``fleet`` if given, else the fleet file the dev control-plane's settings name
    (relative to the repository)."""
    if fleet is not None:
        return fleet
    cp = control_plane(plans)
    settings = yaml.safe_load(cp.config.read_text()) if cp.config is not None else None
    named = (settings or {}).get("fleet_file")
    if not named:
        raise ValueError(f"{cp.config} names no fleet_file")
    return REPO / str(named)


def shift_endpoints(text: str, offset: int, ports: Collection[int]) -> str:
    """``text`` with every local endpoint on one of ``ports`` moved by ``offset``.

    A textual edit, so the copy keeps the original's comments and layout: with offset 0
    it is the original, byte for byte. Endpoints elsewhere are not ours to move.
    """

    def shift(match: re.Match[str]) -> str:
        port = int(match["port"])
        return match["head"] + str(port + offset if port in ports else port)

    return LOCAL_ENDPOINT.sub(shift, text)


def write_fleet(plans: Sequence[Plan], opts: Options) -> Path:
    """The fleet file the control-plane will read; with an offset, a shifted copy.

    Without an offset the control-plane reads the original, so `config reload` after
    editing configs/fleet.yaml works as the README says.
    """
    source = fleet_source(plans, opts.fleet)
    if not opts.port_offset:
        return source
    ours = {port for plan in plans for port in plan.spec.all_ports().values()}
    copy = opts.state_dir / FLEET_COPY
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(shift_endpoints(source.read_text(), opts.port_offset, ours))
    return copy


def fleet_providers(fleet: Path) -> frozenset[str]:
    """Every provider id under ``nodes[]``: what the catalog must show available."""
    data = yaml.safe_load(fleet.read_text()) or {}
    nodes = data.get("nodes") or []
    return frozenset(str(p["id"]) for node in nodes for p in node.get("providers") or [])


# --- preflight: everything that can be wrong is found before anything starts ---------------


def port_is_free(port: int) -> bool:
    """Bind and listen as the services will (aiohttp sets SO_REUSEADDR), then let go."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
            sock.listen()
        except OSError:
            return False
    return True


def check_ports(plans: Sequence[Plan], opts: Options) -> list[str]:
    problems: list[str] = []
    for plan in plans:
        for purpose, base in plan.spec.all_ports().items():
            port = base + opts.port_offset
            if not 0 < port < 65536:
                problems.append(f"{plan.name} {purpose} {port} is out of range (--port-offset?)")
            elif not port_is_free(port):
                problems.append(
                    f"port {port} on {HOST} ({purpose} of {plan.name}) is already in use; "
                    "stop whatever holds it or choose another --port-offset"
                )
    return problems


def check_files(plans: Sequence[Plan], opts: Options) -> list[str]:
    problems: list[str] = []
    for plan in plans:
        program, config = plan.program, plan.config
        if plan.spec.argv:
            if not program.is_file():
                problems.append(f"{plan.name}: {program} does not exist")
        elif not os.access(program, os.X_OK):
            problems.append(f"{plan.name}: {program} is missing or not executable (make install?)")
        if config is not None and not config.is_file():
            problems.append(f"{plan.name}: settings file {config} does not exist")
        if plan.spec.tls:
            missing = [p for p in cert_files(opts.certs, plan.name).values() if not p.is_file()]
            problems += [f"{plan.name}: {p} does not exist (make certs?)" for p in missing]
    return problems


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but it exists
    return True


def runs_script(pid: int, script: str) -> bool:
    """Guard against a recycled pid where /proc lets us look; elsewhere trust the pid."""
    if not Path("/proc/self").exists():
        return True
    try:
        return script in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def live_pid(plan: Plan) -> int | None:
    """The process a pid file names if it is still ours and running; ``None`` if stale."""
    try:
        pid = int(plan.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid > 0 and process_exists(pid) and runs_script(pid, plan.spec.script):
        return pid
    return None


def check_pid_files(plans: Sequence[Plan]) -> list[str]:
    """Refuse to run a second copy over a live one; a stale pid file is just removed."""
    problems: list[str] = []
    for plan in plans:
        if not plan.pid_file.exists():
            continue
        pid = live_pid(plan)
        if pid is None:
            plan.pid_file.unlink(missing_ok=True)
        else:
            problems.append(
                f"{plan.name} is already running as pid {pid} ({plan.pid_file}); "
                f"stop it first (kill -TERM -{pid}) or use another --run-dir"
            )
    return problems


def preflight(plans: Sequence[Plan], opts: Options) -> list[str]:
    return (
        check_ports(plans, opts)
        + check_files(plans, opts)
        + check_pid_files(plans)
        + check_vllm(plans)
    )


def check_vllm(plans: Sequence[Plan]) -> list[str]:
    """vLLM's venv and converted model, which ``make vllm`` makes (the launcher checks
    them too, but only once it runs, a minute into the stack's start)."""
    if not any(plan.spec is VLLM_SERVICE for plan in plans):
        return []
    needed = (REPO / ".venv-vllm" / "bin" / "python", REPO / VLLM_MODEL / "config.json")
    return [f"vllm: {path} does not exist (make vllm)" for path in needed if not path.exists()]


# --- output ------------------------------------------------------------------------------


class Console:
    """Writes every line of the stack to our stdout, each prefixed with whose it is."""

    def __init__(self, names: Sequence[str], *, color: bool) -> None:
        self.width = max(len(n) for n in (*names, SELF))
        codes = {name: COLORS[i % len(COLORS)] for i, name in enumerate(names)}
        self.colors = codes if color else {}

    def line(self, name: str, text: str) -> None:
        prefix = f"{name:<{self.width}} |"
        if name in self.colors:
            prefix = f"\033[{self.colors[name]}m{prefix}\033[0m"
        self.write(f"{prefix} {text}")

    def say(self, text: str) -> None:
        self.line(SELF, text)

    def error(self, text: str) -> None:
        print(f"{SELF}: error: {text}", file=sys.stderr, flush=True)

    @staticmethod
    def write(text: str) -> None:
        with contextlib.suppress(BrokenPipeError):  # `make run | head` is no reason to crash
            print(text, flush=True)


def wants_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


async def pump_output(
    stream: asyncio.StreamReader, name: str, console: Console, ready: asyncio.Event
) -> None:
    """Copy a child's merged stdout/stderr line by line, and notice its ``ready:`` line."""
    while True:
        try:
            raw = await stream.readline()
        except ValueError:  # longer than LINE_LIMIT; asyncio has already dropped it
            console.line(name, f"[devstack: dropped a line longer than {LINE_LIMIT} bytes]")
            continue
        if not raw:
            return
        text = raw.decode(errors="replace").rstrip("\r\n")
        console.line(name, text)
        if READY_LINE.search(text):
            ready.set()


# --- children ----------------------------------------------------------------------------


@dataclass(eq=False)
class Child:
    """A started service: its process, and the tasks that follow its output and its exit."""

    plan: Plan
    proc: asyncio.subprocess.Process
    exited: asyncio.Task[int]
    pump: asyncio.Task[None]
    ready: asyncio.Event
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Backoff:
    """The delay before each restart of one service.

    It doubles up to ``max_s`` while the service keeps exiting soon after it started,
    so one that cannot run does not spin the machine, and falls back to ``first_s``
    once the service had stayed up ``stable_s``: one crash a day is restarted at once.
    """

    first_s: float = RESTART_FIRST_S
    max_s: float = RESTART_MAX_S
    stable_s: float = RESTART_STABLE_S
    _next_s: float | None = field(default=None, init=False, repr=False)

    def after(self, uptime_s: float) -> float:
        """The delay before the next start of a service that ran ``uptime_s`` seconds."""
        if self._next_s is None or uptime_s >= self.stable_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay


def signal_group(pgid: int, signum: signal.Signals) -> None:
    """Signal a child's whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def write_pid_file(path: Path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")


async def spawn(plan: Plan, console: Console) -> Child:
    """Start one service in its own session, so only we decide when it gets a signal."""
    proc = await asyncio.create_subprocess_exec(
        *plan.argv,
        cwd=REPO,
        env=dict(plan.env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        limit=LINE_LIMIT,
    )
    ready = asyncio.Event()
    assert proc.stdout is not None
    pump = asyncio.create_task(pump_output(proc.stdout, plan.name, console, ready))
    return Child(plan, proc, asyncio.create_task(proc.wait()), pump, ready)


async def poll_health(session: aiohttp.ClientSession, url: str) -> None:
    """Return once ``url`` answers 200: the readiness signal for a child that logs no line."""
    timeout = aiohttp.ClientTimeout(total=1.0)
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with session.get(url, timeout=timeout) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(POLL_INTERVAL_S)


# The edge's admin port (loopback, no API key) publishes each provider's health as
# `iop_edge_provider_health{provider="...",state="available"} 1.0`.
HEALTH_SAMPLE = re.compile(
    r'^iop_edge_provider_health\{(?=[^}]*provider="(?P<provider>[^"]+)")'
    r'(?=[^}]*state="(?P<state>[^"]+)")[^}]*\} 1(?:\.0)?$',
    re.MULTILINE,
)


async def poll_providers(
    session: aiohttp.ClientSession,
    url: str,
    expected: frozenset[str],
    seen: dict[str, str],
    metrics_url: str | None = None,
) -> int:
    """Return how many providers the catalog lists once all of them, and ``expected``, are
    available. ``seen`` keeps the last answer (provider id -> health) for error messages.

    ``expected`` matters because a node's providers appear only once the node registers:
    a catalog without them is not a catalog of available providers. Once API keys exist
    the catalog answers 401 to a caller without one (this script has none): then the
    providers' health is read from the edge's admin ``metrics_url`` instead.
    """
    timeout = aiohttp.ClientTimeout(total=2.0)
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with session.get(url, timeout=timeout) as response:
                if response.status == 200:
                    rows = (await response.json())["data"]
                    seen.clear()
                    seen.update({str(r["provider_id"]): str(r["health"]) for r in rows})
                elif response.status == 401 and metrics_url is not None:
                    async with session.get(metrics_url, timeout=timeout) as metrics:
                        text = await metrics.text()
                    seen.clear()
                    seen.update((m["provider"], m["state"]) for m in HEALTH_SAMPLE.finditer(text))
        if seen and expected <= seen.keys() and set(seen.values()) == {AVAILABLE}:
            return len(seen)
        await asyncio.sleep(POLL_INTERVAL_S)


def describe_providers(expected: frozenset[str], seen: Mapping[str, str]) -> str:
    missing = [f"{pid} (not in the catalog)" for pid in sorted(expected - seen.keys())]
    other = [f"{pid} ({health})" for pid, health in sorted(seen.items()) if health != AVAILABLE]
    return ", ".join(missing + other) or "none listed"


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Stack:
    """The children started so far, in start order, and how to stop them all."""

    def __init__(self, console: Console, opts: Options) -> None:
        self.console = console
        self.opts = opts
        self.children: list[Child] = []
        self.retired: list[asyncio.Task[None]] = []  # output pumps of children since restarted
        self.hurry = asyncio.Event()  # a second Ctrl-C: stop waiting for graceful exits

    async def start(self, plans: Sequence[Plan], stop: asyncio.Event) -> str | None:
        """Start each service once the previous one is ready; return a failure or ``None``."""
        async with aiohttp.ClientSession() as session:
            for plan in plans:
                if stop.is_set():
                    return None
                failure = await self.start_one(plan, session, stop)
                if failure is not None:
                    return failure
        return None

    async def start_one(
        self, plan: Plan, session: aiohttp.ClientSession, stop: asyncio.Event
    ) -> str | None:
        self.console.say(f"starting {plan.name} ({plan.spec.port_role} {plan.admin_url})")
        try:
            child = await spawn(plan, self.console)
        except OSError as exc:
            return f"could not start {plan.name}: {exc}"
        self.children.append(child)  # from here on, stop_all() owns it
        try:
            write_pid_file(plan.pid_file, child.proc.pid)
        except OSError as exc:
            return f"could not write {plan.pid_file}: {exc}"
        failure = await self.wait_ready(child, session, stop)
        if failure is None and not stop.is_set():
            self.console.say(f"{plan.name} is ready")
        return failure

    async def race(
        self,
        goals: Sequence[asyncio.Task[Any]],
        stop: asyncio.Event,
        within_s: float | None,
        watching: Collection[Child] | None = None,
    ) -> set[asyncio.Task[Any]]:
        """Wait for the first of ``goals``, a stop request or a child's exit; cancel the rest.

        By default every child started so far is watched: while the stack comes up it
        is only as up as its weakest member. Returns what finished; empty after
        ``within_s``.
        """
        helpers = [*goals, asyncio.create_task(stop.wait())]
        exits = {c.exited for c in (self.children if watching is None else watching)}
        try:
            done, _ = await asyncio.wait(
                {*exits, *helpers}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            await cancel_all(helpers)
        return done

    def ready_timeout(self, plan: Plan) -> float:
        """How long ``plan``'s service may take to be ready: its own bound, if it has one."""
        own = plan.spec.ready_timeout_s
        return self.opts.ready_timeout if own is None else max(own, self.opts.ready_timeout)

    async def wait_ready(
        self, child: Child, session: aiohttp.ClientSession, stop: asyncio.Event
    ) -> str | None:
        """Wait for the ready line or a healthy health URL; return why not, or ``None``.

        A stop request also returns ``None``; the caller checks ``stop`` itself.
        """
        url = child.plan.admin_url + child.plan.spec.health_path
        goals = [
            asyncio.create_task(poll_health(session, url)),
            asyncio.create_task(child.ready.wait()),
        ]
        within = self.ready_timeout(child.plan)
        done = await self.race(goals, stop, within)
        if not done:
            return f"{child.plan.name} was not ready within {within:.0f}s"
        return self.exit_failure(done, "during start-up")

    async def wait_providers(
        self,
        catalog_url: str,
        expected: frozenset[str],
        stop: asyncio.Event,
        metrics_url: str | None = None,
    ) -> tuple[str | None, int]:
        """Wait until the catalog shows every provider available: (why not, how many)."""
        seen: dict[str, str] = {}
        async with aiohttp.ClientSession() as session:
            counting = asyncio.create_task(
                poll_providers(session, catalog_url, expected, seen, metrics_url)
            )
            done = await self.race([counting], stop, self.opts.providers_timeout)
        if counting in done:
            return None, counting.result()
        if not done:
            waiting = describe_providers(expected, seen)
            return (
                f"not every provider was available within {self.opts.providers_timeout:.0f}s "
                f"({catalog_url}): {waiting}",
                0,
            )
        return self.exit_failure(done, "while providers came up"), 0

    def exit_failure(self, done: set[asyncio.Task[Any]], when: str) -> str | None:
        """Name the first child among ``done`` exit tasks, with how it exited."""
        for child in self.children:
            if child.exited in done:
                how = describe_exit(child.exited.result())
                return f"{child.plan.name} exited unexpectedly {when} ({how})"
        return None

    async def supervise(self, stop: asyncio.Event) -> None:
        """Until a stop request, start again every service that exits; return after it.

        One loop per service, each with its own backoff, so one that keeps failing
        delays nobody else. The loops end at a stop request and never while a process
        is being started, so ``stop_all`` afterwards sees every child there is.
        """
        async with asyncio.TaskGroup() as group:
            for index in range(len(self.children)):
                group.create_task(self.keep_running(index, stop))

    async def keep_running(self, index: int, stop: asyncio.Event) -> None:
        backoff = Backoff()
        while True:
            old = self.children[index]
            await self.race([], stop, None, watching=[old])
            if stop.is_set():
                return
            name, uptime = old.plan.name, time.monotonic() - old.started
            signal_group(old.proc.pid, signal.SIGKILL)  # whatever it left in its group
            delay = backoff.after(uptime)
            self.console.say(
                f"{name} exited ({describe_exit(old.exited.result())}) after {uptime:.1f}s; "
                f"restarting it in {delay:.1f}s"
            )
            await self.race([asyncio.create_task(asyncio.sleep(delay))], stop, None, watching=())
            if stop.is_set():
                return
            try:
                child = await self.restart(index)
            except OSError as exc:
                self.console.say(f"could not restart {name}: {exc}; it stays down")
                return
            self.console.say(f"restarted {name} (pid {child.proc.pid})")
            await self.await_restarted(child, stop)

    async def restart(self, index: int) -> Child:
        """Start the service at ``index`` again, in its predecessor's place in the stop order.

        Shielded: once the process is forked it must be ours to stop, even if this
        loop is cancelled meanwhile.
        """
        spawning = asyncio.create_task(spawn(self.children[index].plan, self.console))
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            await asyncio.wait([spawning])
            raise
        finally:
            if spawning.done() and not spawning.cancelled() and spawning.exception() is None:
                child = spawning.result()
                self.retired.append(self.children[index].pump)
                self.children[index] = child
                with contextlib.suppress(OSError):  # the file is for people; we hold the pid
                    write_pid_file(child.plan.pid_file, child.proc.pid)

    async def await_restarted(self, child: Child, stop: asyncio.Event) -> None:
        """Say when a restarted service is ready again; if it is not within
        ``--ready-timeout``, kill it, and its exit brings the next (later) restart."""
        url = child.plan.admin_url + child.plan.spec.health_path
        async with aiohttp.ClientSession() as session:
            goals = [
                asyncio.create_task(poll_health(session, url)),
                asyncio.create_task(child.ready.wait()),
            ]
            within = self.ready_timeout(child.plan)
            done = await self.race(goals, stop, within, watching=[child])
        if stop.is_set() or child.exited in done:
            return
        if done:
            self.console.say(f"{child.plan.name} is ready again")
            return
        self.console.say(f"{child.plan.name} was not ready within {within:.0f}s; killing it")
        signal_group(child.proc.pid, signal.SIGKILL)

    async def stop_all(self) -> None:
        """Stop in reverse start order, so nothing outlives what it depends on."""
        for child in reversed(self.children):
            await self.stop_one(child)
        pumps = [*self.retired, *(child.pump for child in self.children)]
        if pumps:
            await asyncio.wait(pumps, timeout=DRAIN_TIMEOUT_S)
            await cancel_all(pumps)

    async def stop_one(self, child: Child) -> None:
        pgid, name = child.proc.pid, child.plan.name
        if not child.exited.done():
            self.console.say(f"stopping {name}")
            signal_group(pgid, signal.SIGTERM)
            if not await self.stopped_in_time(child):
                self.console.say(f"{name} did not stop in time; killing it")
                signal_group(pgid, signal.SIGKILL)
                await child.exited
        # Anything the service started in its group and left behind goes with it.
        signal_group(pgid, signal.SIGKILL)
        child.plan.pid_file.unlink(missing_ok=True)
        self.console.say(f"stopped {name} ({describe_exit(child.exited.result())})")

    async def stopped_in_time(self, child: Child) -> bool:
        """Give a child ``--stop-timeout`` seconds to exit, or less after a second Ctrl-C."""
        hurry = asyncio.create_task(self.hurry.wait())
        try:
            await asyncio.wait(
                {child.exited, hurry},
                timeout=self.opts.stop_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            await cancel_all([hurry])
        return child.exited.done()


def install_signal_handlers(stop: asyncio.Event, stack: Stack) -> None:
    """SIGINT and SIGTERM ask for a graceful stop; a second one asks to kill right away."""

    def on_signal() -> None:
        if stop.is_set():
            stack.hurry.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)


def ports_line(plans: Sequence[Plan]) -> str:
    urls = ", ".join(f"{plan.name} {plan.spec.port_role} {plan.admin_url}" for plan in plans)
    return f"ports: {urls}; Ctrl-C stops them all"


def up_line(root: str, available: int) -> str:
    """The one line that says the stack is usable: what to point a client at."""
    return (
        f"IOP is up: OpenAI API {root}/v1, catalog {root}/iop/v1/catalog/providers "
        f"({available} providers available)"
    )


async def run(
    plans: Sequence[Plan], opts: Options, console: Console, providers: frozenset[str]
) -> int:
    """Start, supervise, and always stop: the ``finally`` is what leaves nothing running."""
    stop = asyncio.Event()
    stack = Stack(console, opts)
    install_signal_handlers(stop, stack)
    failure: str | None = None
    available = 0
    root = api_root(plans, opts)
    try:
        failure = await stack.start(plans, stop)
        if failure is None and not stop.is_set():
            catalog = f"{root}/iop/v1/catalog/providers"
            console.say(f"waiting for {len(providers)} providers to be available in {catalog}")
            edge = next((p for p in plans if API_PORT_ENV in p.spec.ports), None)
            metrics = f"{edge.admin_url}/metrics" if edge is not None else None
            failure, available = await stack.wait_providers(catalog, providers, stop, metrics)
        if failure is None and not stop.is_set():
            console.say(ports_line(plans))
            console.write(up_line(root, available))
            await stack.supervise(stop)
        if failure is not None:
            console.say(f"{failure}; stopping the rest")
    finally:
        await stack.stop_all()
    if failure is not None:
        console.error(failure)
        return EXIT_FAILED
    console.say("all stopped")
    return EXIT_OK


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="devstack", description="Run every IOP service locally; Ctrl-C stops them all."
    )
    parser.add_argument(
        "--port-offset", type=int, default=0, help="add N to every port (default 0)"
    )
    parser.add_argument(
        "--certs", type=Path, default=REPO / "certs" / "dev", help="dev certificate directory"
    )
    parser.add_argument(
        "--bin",
        type=Path,
        default=Path(sys.executable).parent,
        help="directory of the iop-* console scripts (default: this Python's)",
    )
    parser.add_argument(
        "--run-dir", type=Path, default=REPO / "var" / "run", help="where pid files go"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=REPO / "var" / "dev",
        help="where services keep their state (databases)",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also run vLLM (make vllm) and serve smollm2:135m from llama.cpp and vLLM "
        f"({VLLM_FLEET.relative_to(REPO)})",
    )
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S, help="seconds")
    parser.add_argument("--stop-timeout", type=float, default=STOP_TIMEOUT_S, help="seconds")
    parser.add_argument(
        "--providers-timeout",
        type=float,
        default=PROVIDERS_TIMEOUT_S,
        help="seconds for every provider to become available once all services are ready",
    )
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        port_offset=args.port_offset,
        certs=args.certs.absolute(),
        bin_dir=args.bin.absolute(),
        run_dir=args.run_dir.absolute(),
        state_dir=args.state_dir.absolute(),
        ready_timeout=args.ready_timeout,
        stop_timeout=args.stop_timeout,
        providers_timeout=args.providers_timeout,
        fleet=VLLM_FLEET if args.vllm else None,
    )


def issue_dev_tokens(plans: Sequence[Plan], opts: Options, console: Console) -> list[str]:
    """Give every node a token from the dev control-plane's database, once.

    The token file and the database both live in the state directory, so they
    are made and wiped together; an existing token file is kept.
    """
    cp = control_plane(plans)
    problems: list[str] = []
    for plan in plans:
        token_name = plan.spec.state.get("IOP_TOKEN_FILE")
        if token_name is None:
            continue
        token_file = opts.state_dir / token_name
        if token_file.is_file():
            continue
        token_file.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [str(cp.program), "--config", str(cp.config), "token", "issue", "--node", plan.name],
            env=dict(cp.env),
            capture_output=True,
            text=True,
            check=False,
        )
        token = re.search(r"\biopnt_\S+", result.stdout)
        if result.returncode != 0 or token is None:
            problems.append(f"could not issue a dev token for {plan.name}: {result.stderr.strip()}")
            continue
        token_file.touch(mode=0o600)
        token_file.write_text(token.group(0) + "\n")
        console.say(f"issued a dev token for {plan.name} ({token_file})")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = options_from(args)
    plans = [make_plan(spec, opts) for spec in services(args.vllm)]
    console = Console([plan.name for plan in plans], color=wants_color())
    problems = preflight(plans, opts)
    if problems:
        for problem in problems:
            console.error(problem)
        console.error("nothing was started")
        return EXIT_PREFLIGHT
    try:
        fleet = write_fleet(plans, opts)
        providers = fleet_providers(fleet)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        console.error(f"could not prepare the fleet file: {exc}")
        return EXIT_PREFLIGHT
    problems = issue_dev_tokens(plans, opts, console)
    if problems:
        for problem in problems:
            console.error(problem)
        return EXIT_PREFLIGHT
    return asyncio.run(run(plans, opts, console, providers))


if __name__ == "__main__":
    sys.exit(main())
