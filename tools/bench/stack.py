"""An IOP stack of real processes for the benchmarks: control-plane, edge, node(s).

The same shape as the end-to-end tests' stack (tests/e2e/conftest.py), as code a
benchmark can import: mTLS with certificates from a throwaway CA, a fleet file,
node tokens, SQLite files under a scratch folder, ephemeral ports read from the
services' log lines. Nothing here is faked: a request measured through this stack
crosses the edge's HTTP API, the IOP frame link and the node's adapter.

Tokens are written with the control-plane's own credential store before it starts,
rather than with its CLI: a CLI process per token costs a second on 2 cores, and
the registration benchmark needs a hundred of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
import trustme
import yaml

from iop_control_plane.adapters.sqlite_store import SqliteCredentialStore
from iop_control_plane.domain.credentials import new_node_token
from iop_proto.testing import RunningService, running_service, write_identity
from iop_proto.tls import TlsSettings

from .procs import Gateway

NODE_ID: Final = "bench-node"
READY_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True)
class ProviderSpec:
    """One provider of the bench node; every model it serves is public under its own name."""

    id: str
    type: str  # openai_api | llamacpp | mock
    category: str  # api | local_inference
    models: tuple[str, ...]
    endpoint: str = ""
    capacity: int = 256
    max_queue: int = 16_384
    settings: dict[str, Any] = field(default_factory=dict)

    def fleet_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "id": self.id,
            "type": self.type,
            "category": self.category,
            "models": list(self.models),
            "capacity": self.capacity,
            "max_queue": self.max_queue,
            "queue_timeout_ms": 60_000,
            "request_timeout_ms": 120_000,
            **self.settings,
        }
        if self.endpoint:
            entry["endpoint"] = self.endpoint
        return entry


def fleet_for(
    nodes: Mapping[str, Sequence[ProviderSpec]],
    pools: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """A fleet where each served name is a public model of the same name, plus ``pools``:
    public models of several providers (public id -> provider id -> served name)."""
    models: dict[str, dict[str, str]] = {}
    for providers in nodes.values():
        for provider in providers:
            for served in provider.models:
                models.setdefault(served, {})[provider.id] = served
    models.update({public: dict(members) for public, members in (pools or {}).items()})
    return {
        "models": [{"id": m, "providers": p} for m, p in models.items()],
        "nodes": [
            {"id": node, "providers": [p.fleet_entry() for p in providers]}
            for node, providers in nodes.items()
        ],
    }


def _port(service: RunningService, pattern: str) -> int:
    for line in service.log:
        match = re.search(pattern, line)
        if match:
            return int(match.group(1))
    raise RuntimeError(f"no line matching {pattern!r} in:\n{''.join(service.log)}")


async def issue_tokens(database: Path, node_ids: Iterable[str]) -> dict[str, str]:
    """A node token for each id, stored where the control-plane will find it."""
    store = await SqliteCredentialStore.open(database)
    tokens: dict[str, str] = {}
    try:
        for node_id in node_ids:
            issued = new_node_token(node_id, datetime.now(UTC))
            await store.add_node_token(issued.token)
            tokens[node_id] = issued.plaintext
    finally:
        await store.aclose()
    return tokens


@dataclass
class Core:
    """A running control-plane and edge, and what a node needs to join them."""

    root: Path
    ca: trustme.CA
    services: dict[str, RunningService]
    tokens: dict[str, str]
    edge_url: str  # http://127.0.0.1:PORT, the edge's HTTP API (OpenAI under /v1)
    node_port: int

    @property
    def api_url(self) -> str:
        return f"{self.edge_url}/v1"

    def identity(self, name: str, role: str) -> TlsSettings:
        return write_identity(self.ca, self.root / "pki", name, role)

    def settings_file(self, name: str, role: str, data: dict[str, Any]) -> Path:
        tls = self.identity(name, role)
        base = {
            "service_id": name,
            "admin": {"host": "127.0.0.1", "port": 0},
            "log": {"level": "INFO"},
            "tls": {
                "ca_file": str(tls.ca_file),
                "cert_file": str(tls.cert_file),
                "key_file": str(tls.key_file),
            },
        }
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**base, **data}))
        return path


def _wrapper(python: str | None) -> tuple[str, ...]:
    """What runs a service's console script: another interpreter, or its own shebang."""
    return (python,) if python else ()


def _write_fleet(root: Path, fleet: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path


@contextlib.asynccontextmanager
async def start_core(
    root: Path,
    fleet: dict[str, Any],
    node_ids: Sequence[str],
    *,
    python: str | None = None,
    edge_extra: Mapping[str, Any] | None = None,
) -> AsyncIterator[Core]:
    """Start the control-plane and the edge for ``fleet``; tokens for ``node_ids`` exist.

    ``python``: the interpreter the services run on (their console scripts are run with
    it); by default this venv's own. ``edge_extra``: more of the edge's settings.
    """
    wrapper = _wrapper(python)
    fleet_file = _write_fleet(root, fleet)
    tokens = await issue_tokens(root / "cp.db", node_ids)
    core = Core(root, trustme.CA(), {}, tokens, "", 0)
    cp_settings = core.settings_file(
        "control-plane",
        "control-plane",
        {
            "fleet_file": str(fleet_file),
            "database": str(root / "cp.db"),
            "listen": {"host": "127.0.0.1", "port": 0},
        },
    )
    async with contextlib.AsyncExitStack() as exits:
        cp = await exits.enter_async_context(
            running_service(
                "iop-control-plane", cp_settings, ready_timeout=READY_TIMEOUT_S, wrapper=wrapper
            )
        )
        core.services["control-plane"] = cp
        cp_port = _port(cp, r"listening for edges on [\d.]+:(\d+)")
        edge_settings = core.settings_file(
            "edge",
            "edge",
            {
                "http": {"host": "127.0.0.1", "port": 0},
                "node_listener": {"host": "127.0.0.1", "port": 0},
                "control_plane": {"host": "127.0.0.1", "port": cp_port, "server_name": "localhost"},
                "config_cache": str(root / "edge-cache.pb"),
                "history_db": str(root / "edge-runs.db"),
                "responses_db": str(root / "edge-responses.db"),
                **(edge_extra or {}),
            },
        )
        edge = await exits.enter_async_context(
            running_service(
                "iop-edge", edge_settings, ready_timeout=READY_TIMEOUT_S, wrapper=wrapper
            )
        )
        core.services["edge"] = edge
        api_port = _port(edge, r"OpenAI API on http://[\d.]+:(\d+)/v1")
        core.edge_url = f"http://127.0.0.1:{api_port}"
        core.node_port = _port(edge, r"listening for nodes on [\d.]+:(\d+)")
        yield core


async def wait_models_available(edge_url: str, models: Iterable[str], timeout_s: float) -> None:
    """Until the edge's catalog shows a usable provider for every model (its readiness)."""
    wanted = set(models)
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(timeout_s):
            while True:
                async with http.get(f"{edge_url}/iop/v1/catalog/models") as response:
                    rows = (await response.json())["data"]
                ready = {row["id"] for row in rows if row["available_providers"]}
                if wanted <= ready:
                    return
                await asyncio.sleep(0.05)


@dataclass
class IopStack:
    """The gateway under test: one edge and one node in front of the providers."""

    core: Core
    node: RunningService

    @property
    def api_url(self) -> str:
        return self.core.api_url

    def gateway(self) -> Gateway:
        return Gateway(
            "iop",
            {
                "edge": self.core.services["edge"].process.pid,
                "node": self.node.process.pid,
            },
        )


@contextlib.asynccontextmanager
async def start_iop(
    root: Path,
    providers: Sequence[ProviderSpec],
    *,
    probe_interval_s: float = 2.0,
    pools: Mapping[str, Mapping[str, str]] | None = None,
    python: str | None = None,
    edge_extra: Mapping[str, Any] | None = None,
) -> AsyncIterator[IopStack]:
    """Control-plane, edge and the bench node serving ``providers``, all ready.

    ``probe_interval_s``: how often the node probes its providers (``hops.py`` sets it
    past its whole measurement, so that no probe lands in a traced window).
    ``python``: the services' interpreter (``ab.py`` compares two), as in ``start_core``;
    ``edge_extra``: more of the edge's settings.
    """
    fleet = fleet_for({NODE_ID: providers}, pools)
    async with start_core(root, fleet, [NODE_ID], python=python, edge_extra=edge_extra) as core:
        settings = core.settings_file(
            NODE_ID,
            "node",
            {
                "edge": {"host": "127.0.0.1", "port": core.node_port, "server_name": "localhost"},
                "token": core.tokens[NODE_ID],
                "history_db": str(root / "node-history.db"),
                "probes": {"interval_s": probe_interval_s},
            },
        )
        node_service = running_service(
            "iop-node", settings, ready_timeout=READY_TIMEOUT_S, wrapper=_wrapper(python)
        )
        async with node_service as node:
            edge = core.services["edge"]
            await asyncio.wait_for(
                edge.wait_for_line(f"node {NODE_ID} registered"), READY_TIMEOUT_S
            )
            served = [m for p in providers for m in p.models] + list(pools or {})
            await wait_models_available(core.edge_url, served, READY_TIMEOUT_S)
            yield IopStack(core, node)
