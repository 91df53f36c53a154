"""A real IOP stack for end-to-end and fault tests: control-plane, edge and two nodes as processes.

Every link is real: mTLS with certificates from a throwaway CA, the fleet file,
tokens issued by the control-plane's CLI, SQLite files, and mock providers
(the mock adapter is one adapter among others; the transport is all real).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import trustme
import yaml

from iop_proto.testing import RunningService, running_service, write_identity
from iop_proto.tls import TlsSettings

ROLES = {
    "control-plane": "control-plane",
    "edge": "edge",
    "edge-b": "edge",  # a second edge of the same fleet (tests/faults/test_several_edges.py,
    # test_edge_ha.py)
    "node-a": "node",
    "node-b": "node",
    "node-fuzz": "node",  # in the fleet without providers: fault tests register as it
    "worker": "worker",
    "worker-evil": "worker",  # a second worker identity: security tests forge lease operations
}


def mock(provider_id: str, served: str, capacity: int = 2, **settings: object) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": capacity,
        "max_queue": 2,
        "queue_timeout_ms": 1500,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 200,
        **settings,
    }


FLEET: dict[str, object] = {
    "models": [
        {
            "id": "mock-small",
            "display_name": "Mock (small)",
            "providers": {"node-a-mock": "mock-small", "node-b-mock": "mock-small-b"},
        },
        {"id": "solo", "providers": {"node-a-solo": "solo-served"}},
    ],
    "nodes": [
        {
            "id": "node-a",
            "providers": [mock("node-a-mock", "mock-small"), mock("node-a-solo", "solo-served", 1)],
        },
        {"id": "node-b", "providers": [mock("node-b-mock", "mock-small-b")]},
        {"id": "node-fuzz", "providers": []},
    ],
}


@dataclass
class Stack:
    root: Path
    services: dict[str, RunningService] = field(default_factory=dict)
    api_url: str = ""
    edge_admin: str = ""
    fleet_file: Path = Path()
    cp_settings: Path = Path()
    ca: Any = None  # the stack's trustme CA, for tests that need odd certificates
    cp_port: int = 0  # where edges dial the control-plane
    node_port: int = 0  # where nodes and workers dial the edge

    _running: dict[str, contextlib.AbstractAsyncContextManager[RunningService]] = field(
        default_factory=dict
    )

    async def start(
        self, name: str, wrapper: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> RunningService:
        """Start (or start again) a service from its settings file in the stack's root;
        ``wrapper`` execs it (``Namespace.wrapper``: inside a network namespace); ``env``:
        ``IOP_*`` overrides of its settings."""
        script = SCRIPTS.get(name, "iop-node")
        context = running_service(script, self.root / f"{name}.yaml", env=env, wrapper=wrapper)
        service = await context.__aenter__()
        self._running[name] = context
        self.services[name] = service
        return service

    async def stop(self, name: str, signal_number: int = signal.SIGTERM) -> int:
        """Stop one service (SIGKILL for a crash); returns its exit code."""
        service = self.services[name]
        if service.process.returncode is None:
            service.process.send_signal(signal_number)
        code = await asyncio.wait_for(service.process.wait(), 30)
        await self._running.pop(name).__aexit__(None, None, None)
        return code

    async def stop_all(self) -> None:
        for name in reversed(list(self._running)):
            await self.stop(name)

    def pin_ports(self, name: str) -> None:
        """Write the ports a service bound (started with port 0) into its settings file, so
        that a restart comes back on the same ones (its peers dial them)."""
        path = self.root / f"{name}.yaml"
        data = yaml.safe_load(path.read_text())
        for port_name, port in self.services[name].ports.items():
            data[PORT_KEYS[port_name]]["port"] = port
        path.write_text(yaml.safe_dump(data))

    async def wait_registered(self, peers: Iterable[str], timeout_s: float = 20) -> None:
        """Until each node or worker is registered with the running edge.

        A node: its own ``/readyz`` says registered and the edge's catalog shows its
        providers connected; a worker: its ``/readyz`` (it is ready once registered).
        """
        async with aiohttp.ClientSession() as http, asyncio.timeout(timeout_s):
            for peer in peers:
                while not await self._registered(http, peer):  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.05)

    async def _registered(self, http: aiohttp.ClientSession, peer: str) -> bool:
        async with http.get(f"{self.services[peer].admin_url}/readyz") as response:
            if response.status != 200:
                return False
        if peer.startswith("worker"):
            return True
        catalog = self.api_url.replace("/v1", "/iop/v1/catalog/providers")
        async with http.get(catalog) as response:
            if response.status == 401:  # keys exist: the node's own readiness is what shows
                return True
            if response.status != 200:
                return False
            rows = (await response.json())["data"]
        return all(row["connected"] for row in rows if row["node_id"] == peer)

    def tls(self, name: str) -> TlsSettings:
        """Settings for one identity of the stack's throwaway CA."""
        pki = self.root / "pki"
        return TlsSettings(
            ca_file=pki / "ca.pem", cert_file=pki / f"{name}.pem", key_file=pki / f"{name}.key"
        )

    def settings_file(self, name: str, data: dict[str, object]) -> Path:
        tls = {
            "ca_file": str(self.root / "pki" / "ca.pem"),
            "cert_file": str(self.root / "pki" / f"{name}.pem"),
            "key_file": str(self.root / "pki" / f"{name}.key"),
        }
        path = self.root / f"{name}.yaml"
        base = {"service_id": name, "admin": {"host": "127.0.0.1", "port": 0}, "tls": tls}
        path.write_text(yaml.safe_dump({**base, **data}))
        return path

    def second_edge_settings(self, name: str = "edge-b") -> Path:
        """Settings for another edge of the stack: the first's (the same control-plane and
        stores), with its own identity, ports (0: any) and local files."""
        first = yaml.safe_load((self.root / "edge.yaml").read_text())
        settings = {k: v for k, v in first.items() if k not in ("service_id", "admin", "tls")}
        settings["http"] = {**settings["http"], "port": 0}
        settings["node_listener"] = {**settings["node_listener"], "port": 0}
        for key in ("config_cache", "history_db", "responses_db", "batch_db"):
            settings[key] = str(self.root / f"{name}-{Path(first[key]).name}")
        return self.settings_file(name, settings)

    async def control_plane_cli(self, *args: str) -> str:
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "iop-control-plane"),
            "--config",
            str(self.cp_settings),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        return out.decode()

    async def issue_key(self, name: str, *options: str, within_s: float = 20) -> str:
        """A key from the control-plane's CLI, returned once the edge serves it and, the API
        no longer open, refuses a key nobody issued (within ``within_s``)."""
        out = await self.control_plane_cli("key", "issue", "--name", name, *options)
        found = re.search(r"sk-iop-\S+", out)
        assert found is not None, out
        secret = found.group(0)
        ours = {"Authorization": f"Bearer {secret}"}
        bogus = {"Authorization": "Bearer sk-iop-not-a-key"}
        async with aiohttp.ClientSession() as http, asyncio.timeout(within_s):
            while True:  # an open edge (no key yet) serves any key: wait for the bogus one's 401
                async with http.get(f"{self.api_url}/models", headers=ours) as mine:
                    async with http.get(f"{self.api_url}/models", headers=bogus) as theirs:
                        if mine.status == 200 and theirs.status == 401:
                            return secret
                await asyncio.sleep(0.05)


SCRIPTS = {
    "control-plane": "iop-control-plane",
    "edge": "iop-edge",
    "edge-b": "iop-edge",
    "worker": "iop-worker",
}
PORT_KEYS = {"edges": "listen", "http": "http", "nodes": "node_listener"}
"""The settings section of each port a service reports (``RunningService.ports``)."""


@contextlib.asynccontextmanager
async def start_stack(
    root: Path,
    fleet: dict[str, object],
    edge_settings: dict[str, object] | None = None,
    *,
    drills: bool = True,
    node_settings: dict[str, object] | None = None,
) -> AsyncIterator[Stack]:
    """The stack for ``fleet``; ``edge_settings``: top-level keys of the edge's settings
    to set (a section replaces the stack's, e.g. ``node_listener``). ``drills``: the
    test fleet honours the mock's failure drills (``iop_mock``) from every caller, as a
    real one does not (the edge's ``mock_drills``, off by default); False: the default.
    ``node_settings``: top-level keys of both nodes' settings to set (e.g. ``tracing``)."""
    ca = trustme.CA()
    for name, role in ROLES.items():
        write_identity(ca, root / "pki", name, role)
    stack = Stack(root)
    stack.ca = ca
    stack.fleet_file = root / "fleet.yaml"
    stack.fleet_file.write_text(yaml.safe_dump(fleet))
    stack.cp_settings = stack.settings_file(
        "control-plane",
        {
            "fleet_file": str(stack.fleet_file),
            "database": str(root / "cp.db"),
            "listen": {"host": "127.0.0.1", "port": 0},
            "credentials_poll_s": 0.2,
        },
    )
    try:
        # Every service binds port 0 and reports what it got; restarts reuse it (pin_ports).
        stack.cp_port = (await stack.start("control-plane")).ports["edges"]
        stack.pin_ports("control-plane")
        stack.settings_file(
            "edge",
            {
                "http": {"host": "127.0.0.1", "port": 0},
                "node_listener": {"host": "127.0.0.1", "port": 0},
                "control_plane": {
                    "host": "127.0.0.1",
                    "port": stack.cp_port,
                    "server_name": "localhost",
                },
                "config_cache": str(root / "edge-cache.pb"),
                "history_db": str(root / "edge-runs.db"),
                "responses_db": str(root / "edge-responses.db"),
                "batch_db": str(root / "edge-batches.db"),
                "batch_lease_ttl_s": 3,
                **({"mock_drills": True} if drills else {}),
                **(edge_settings or {}),
            },
        )
        edge = await stack.start("edge")
        stack.pin_ports("edge")
        stack.edge_admin = edge.admin_url
        stack.api_url = f"http://127.0.0.1:{edge.ports['http']}/v1"
        stack.node_port = edge.ports["nodes"]
        stack.settings_file(
            "worker",
            {
                "edge": {"host": "127.0.0.1", "port": stack.node_port, "server_name": "localhost"},
                "concurrency": 4,
                "poll_interval_s": 0.2,
                "lease_renew_interval_s": 1,
                "reconnect": {"initial_s": 0.1, "max_s": 0.5},
            },
        )
        for node in ("node-a", "node-b"):
            out = await stack.control_plane_cli("token", "issue", "--node", node)
            token = re.search(r"iopnt_\S+", out)
            assert token is not None
            stack.settings_file(
                node,
                {
                    "edge": {
                        "host": "127.0.0.1",
                        "port": stack.node_port,
                        "server_name": "localhost",
                    },
                    "token": token.group(0),
                    "history_db": str(root / f"{node}-history.db"),
                    "probes": {"interval_s": 0.2},
                    "reconnect": {"initial_s": 0.1, "max_s": 0.5},
                    **(node_settings or {}),
                },
            )
            await stack.start(node)
        await stack.wait_registered(("node-a", "node-b"))
        await stack.start("worker")
        await stack.wait_registered(("worker",))
        yield stack
    finally:
        await stack.stop_all()


@dataclass(frozen=True)
class Namespace:
    """A network namespace whose only link is a veth pair to this host (a /30, no route
    out): a client or a node "on another host", and a link that can be cut silently."""

    name: str
    host_if: str  # this host's end of the veth pair
    host_address: str
    client_address: str  # the namespace's end

    @property
    def wrapper(self) -> tuple[str, ...]:
        """Prefix of a command run inside the namespace (``Stack.start(wrapper=...)``)."""
        return ("ip", "netns", "exec", self.name)

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.wrapper, *command],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={**os.environ},
        )

    def cut(self) -> None:
        """Take the link down: nothing more crosses it, and nobody is told (no RST, no FIN)."""
        _ip("link", "set", self.host_if, "down")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def veth_namespace(tag: str, subnet: int) -> Iterator[Namespace]:
    """A namespace named for ``tag`` (a letter or two) on ``10.<subnet>.<n>.0/30``; skips the
    test where there is no root or no ``ip netns``."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 ('ip netns') for a second network host")
    n = os.getpid() % 250 + 1  # unique per run, so parallel runs do not collide
    name, host_if, ns_if = f"iop{tag}{n}", f"iop{tag}{n}h", f"iop{tag}{n}n"
    ns = Namespace(name, host_if, f"10.{subnet}.{n}.1", f"10.{subnet}.{n}.2")
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"'ip netns add' is not usable here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{ns.host_address}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{ns.client_address}/30", "dev", ns_if)
        _ip("-n", name, "link", "set", ns_if, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)


@pytest.fixture(scope="session")
def netns_factory() -> object:
    """``veth_namespace`` for test modules (a conftest cannot be imported)."""
    return veth_namespace


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with start_stack(tmp_path_factory.mktemp("stack"), FLEET) as running:
        yield running


@pytest.fixture(scope="session")
def start_stack_factory() -> object:
    """``start_stack`` for test modules that need a stack with a fleet of their own."""
    return start_stack
