"""tools/devstack.py, run for real: the whole stack comes up, answers, and leaves nothing behind.

Each test runs the program as a subprocess (as ``make run`` does), on admin ports
shifted to a free range and with certificates and pid files under ``tmp_path``, so
it can run next to a developer's own ``make run``. Output is read with deadlines,
never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import random
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
SCRIPT = TOOLS / "devstack.py"
HOST = "127.0.0.1"
UP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0

pytestmark = pytest.mark.slow


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
# Every port the stack listens on (admin ports and the IOP listeners), before the offset.
ALL_PORTS: list[int] = [port for spec in devstack.SERVICES for port in spec.all_ports().values()]


def port_is_free(port: int) -> bool:
    """Free for the next start: bindable as the services bind (SO_REUSEADDR, so the
    TIME_WAIT of connections the stack closed does not count as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port_offset() -> int:
    """An offset putting every admin port in a free range below the ephemeral ports."""
    rng = random.Random()
    for _ in range(200):
        offset = rng.randrange(20000, 30000) - min(BASE_PORTS)
        if all(port_is_free(port + offset) for port in ALL_PORTS):
            return offset
    pytest.fail("found no range of free ports for the stack")


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

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def read_until(self, marker: str, within_s: float) -> str:
        """Read lines until one contains ``marker``; fail on EOF or after ``within_s``."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(within_s):
                while raw := await self.proc.stdout.readline():
                    line = raw.decode(errors="replace").rstrip("\n")
                    self.lines.append(line)
                    if marker in line:
                        return line
        except TimeoutError:
            pytest.fail(f"no {marker!r} within {within_s}s; output:\n{self.output}")
        pytest.fail(f"devstack ended before {marker!r}; output:\n{self.output}")

    async def finish(self, within_s: float) -> int:
        """Read the rest of the output and the exit code."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(within_s):
            rest = await self.proc.stdout.read()
            self.lines += rest.decode(errors="replace").splitlines()
            return await self.proc.wait()

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
    return free_port_offset()


async def healthz(session: aiohttp.ClientSession, port: int) -> int:
    async with session.get(f"http://{HOST}:{port}/healthz") as response:
        return response.status


async def test_stack_comes_up_and_stops_cleanly(tmp_path: Path, certs: Path, offset: int) -> None:
    run_dir = tmp_path / "run"
    write_stale_pid_files(run_dir)
    ports = {name: port + offset for name, port in zip(NAMES, BASE_PORTS, strict=True)}
    args = (
        "--port-offset",
        str(offset),
        "--certs",
        str(certs),
        "--bin",
        str(Path(sys.executable).parent),
    )
    async with launch(*args, run_dir=run_dir) as stack:
        up = await stack.read_until("IOP is up", UP_TIMEOUT_S)
        for name, port in ports.items():
            assert f"{name} http://{HOST}:{port}" in up

        pids = stack.pid_files()
        assert sorted(pids) == sorted(NAMES)
        async with aiohttp.ClientSession() as session:
            statuses = {name: await healthz(session, port) for name, port in ports.items()}
        assert statuses == dict.fromkeys(NAMES, 200)

        stack.proc.send_signal(signal.SIGTERM)
        code = await stack.finish(STOP_TIMEOUT_S)

    assert code == 0, stack.output
    assert [pid for pid in pids.values() if not process_gone(pid)] == []
    assert list(run_dir.glob("*.pid")) == []
    assert_prefixed(stack.lines)
    assert all(port_is_free(port + offset) for port in ALL_PORTS)


def assert_prefixed(lines: list[str]) -> None:
    """Each child's own ready line is prefixed with its name, all at one column."""
    prefixed = [line for line in lines if re.match(r"^\S+ +\| ", line)]
    assert len({line.index(" | ") for line in prefixed}) == 1, "prefixes of unequal width"
    for name in NAMES:
        ready = re.compile(rf"^{re.escape(name)} +\| .*\bready: {re.escape(name)} admin http://")
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
    assert port_is_free(first), "the first service must not have been started"
