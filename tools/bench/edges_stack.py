"""Several edges over one node, for the ``edges`` scenario and tools/hardening/limits_sustained.py.

A control-plane, ``count`` edges (the first from ``stack.start_core``, the others with its
settings, their own identity, ports and local files, and the same shared store when
``postgres_dsn`` is given), one node serving ``providers`` that dials every edge (its
``edges`` setting names them all, so no edge waits for the control-plane's list), and
``tools/tcp_balancer.py`` processes in front of some of the edges' HTTP ports. Every
process is real, as in ``stack.py``; ``pids`` names each one, for CPU per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml

from iop_control_plane.adapters.sqlite_store import SqliteCredentialStore
from iop_control_plane.domain.credentials import new_api_key
from iop_proto.testing import RunningService, running_service

from .procs import spawn
from .stack import NODE_ID, READY_TIMEOUT_S, Core, ProviderSpec, fleet_for, start_core

BALANCER: Final = Path(__file__).resolve().parent.parent / "tcp_balancer.py"
_BALANCER_READY: Final = re.compile(r"ready: balancer (http://\S+)")


@dataclass
class EdgesStack:
    """The running processes: each edge's API, the balancers', and every pid by name."""

    core: Core
    edge_urls: list[str]  # http://127.0.0.1:PORT of each edge (no /v1)
    edge_services: dict[str, RunningService]
    node: RunningService | None = None
    balancers: dict[str, str] = field(default_factory=dict)  # name -> http://HOST:PORT
    pids: dict[str, int] = field(default_factory=dict)  # process name -> pid

    @property
    def root(self) -> Path:
        return self.core.root


async def add_api_keys(database: Path, limits: Mapping[str, int]) -> dict[str, str]:
    """API keys (name -> max_concurrent, 0: none) stored where the control-plane will find
    them, before it starts; their secrets by name."""
    store = await SqliteCredentialStore.open(database)
    secrets: dict[str, str] = {}
    try:
        for name, limit in limits.items():
            issued = new_api_key(name, (), limit, datetime.now(UTC))
            await store.add_api_key(issued.key)
            secrets[name] = issued.plaintext
    finally:
        await store.aclose()
    return secrets


def _edge_settings(core: Core, name: str) -> Path:
    """Edge ``name``'s settings: the first edge's, with its own identity, ports and files."""
    first = yaml.safe_load((core.root / "edge.yaml").read_text())
    data = {k: v for k, v in first.items() if k not in ("service_id", "admin", "tls", "log")}
    data["http"] = {**data["http"], "port": 0}
    data["node_listener"] = {**data["node_listener"], "port": 0}
    for key in ("config_cache", "history_db", "responses_db"):
        data[key] = str(core.root / f"{name}-{Path(first[key]).name}")
    data["batch_db"] = str(core.root / f"{name}-batches.db")
    return core.settings_file(name, "edge", data)


@contextlib.asynccontextmanager
async def start_edges(
    root: Path,
    providers: Sequence[ProviderSpec],
    *,
    count: int = 2,
    balancers: Mapping[str, Sequence[int]] | None = None,
    postgres_dsn: str | None = None,
    edge_extra: Mapping[str, Any] | None = None,
    keys: Mapping[str, int] | None = None,
    node_extra: Mapping[str, Any] | None = None,
) -> AsyncIterator[tuple[EdgesStack, dict[str, str]]]:
    """``count`` edges, one node dialling all of them, and a balancer per entry of
    ``balancers`` (name -> indexes of the edges it spreads over); yields the stack and
    the secrets of ``keys`` (name -> max_concurrent), once every edge serves the models.
    ``edge_extra``, ``node_extra``: more of the edges' and the node's settings."""
    secrets = await add_api_keys(root / "cp.db", keys or {}) if keys else {}
    extra = dict(edge_extra or {})
    extra.setdefault("batch_db", str(root / "edge-batches.db"))
    if postgres_dsn is not None:
        extra["postgres"] = {"dsn": postgres_dsn}
    fleet = fleet_for({NODE_ID: providers})
    async with start_core(root, fleet, [NODE_ID], edge_extra=extra) as core:
        async with contextlib.AsyncExitStack() as exits:
            first = core.services["edge"]
            stack = EdgesStack(core, [core.edge_url], {"edge-1": first})
            stack.pids = {"control-plane": core.services["control-plane"].process.pid}
            stack.pids["edge-1"] = first.process.pid
            node_ports = [core.node_port]
            for n in range(2, count + 1):
                name = f"edge-{n}"
                service = await exits.enter_async_context(
                    running_service(
                        "iop-edge", _edge_settings(core, name), ready_timeout=READY_TIMEOUT_S
                    )
                )
                stack.edge_services[name] = service
                stack.pids[name] = service.process.pid
                stack.edge_urls.append(f"http://127.0.0.1:{service.ports['http']}")
                node_ports.append(service.ports["nodes"])
            edges = [
                {"host": "127.0.0.1", "port": port, "server_name": "localhost"}
                for port in node_ports
            ]
            settings = core.settings_file(
                NODE_ID,
                "node",
                {
                    "edges": edges,
                    "token": core.tokens[NODE_ID],
                    "history_db": str(root / "node-history.db"),
                    "probes": {"interval_s": 2.0},
                    **(node_extra or {}),
                },
            )
            stack.node = await exits.enter_async_context(
                running_service("iop-node", settings, ready_timeout=READY_TIMEOUT_S)
            )
            stack.pids["node"] = stack.node.process.pid
            served = [m for p in providers for m in p.models]
            auth = next(iter(secrets.values()), None)
            for url in stack.edge_urls:
                await wait_served(url, served, READY_TIMEOUT_S, auth)
            for name, indexes in (balancers or {}).items():
                argv = [sys.executable, str(BALANCER), "--listen", "127.0.0.1:0"]
                for i in indexes:
                    argv += ["--backend", stack.edge_urls[i].removeprefix("http://")]
                child = await exits.enter_async_context(
                    spawn(argv, ready=_BALANCER_READY, log=root / f"{name}.log")
                )
                stack.balancers[name] = child.match.group(1)
                stack.pids[name] = child.pid
            yield stack, secrets


async def wait_served(
    edge_url: str, models: Sequence[str], timeout_s: float, secret: str | None = None
) -> None:
    """Until the edge's catalog shows a usable provider for every model and, with a key,
    the edge knows it (the control-plane's fleet reached it: a key it does not know is
    refused)."""

    wanted = set(models)
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with aiohttp.ClientSession() as http, asyncio.timeout(timeout_s):
        while True:
            url = f"{edge_url}/iop/v1/catalog/models"
            async with http.get(url, headers=headers) as response:
                rows = (await response.json())["data"] if response.status == 200 else []
            served = wanted <= {row["id"] for row in rows if row["available_providers"]}
            if served and secret:  # an edge that knows no key yet is open: not ready
                bogus = {"Authorization": "Bearer sk-iop-not-a-key"}
                async with http.get(f"{edge_url}/v1/models", headers=bogus) as response:
                    served = response.status == 401
            if served:
                return
            await asyncio.sleep(0.05)
