"""The compose stack's files with real services, as processes: what `docker compose up` wires.

No Docker engine here, so the containers are replaced by processes and the named volumes by
directories, and nothing else: the certificates and tokens are made by deploy/init/iop_init.py;
control-plane, edge and node-a read deploy/compose/*.yaml and the compose fleet file; a second
node joins as a node host would (deploy/node-host/node.yaml with the environment of
docker-compose.node.yml and the files of `iop-init --bundle`). Only what differs between a
container and a process is overridden, through the `IOP_*` variables the services read:
paths under /certs, /etc/iop and /var/lib/iop, and loopback addresses instead of service
names (the certificates' names are still checked, through `server_name`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from iop_proto.testing import running_service

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_SETTINGS = ROOT / "deploy" / "compose"
NODE_HOST = ROOT / "deploy" / "node-host"


def tls(directory: Path, cert: str) -> dict[str, str]:
    return {
        "IOP_TLS__CA_FILE": str(directory / "ca.pem"),
        "IOP_TLS__CERT_FILE": str(directory / f"{cert}.pem"),
        "IOP_TLS__KEY_FILE": str(directory / f"{cert}.key"),
    }


def run_init(volumes: Path, *args: str) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOP_")}
    env["IOP_DATABASE"] = str(volumes / "control-plane" / "credentials.db")
    command = [
        sys.executable,
        str(ROOT / "deploy" / "init" / "iop_init.py"),
        "--config",
        str(COMPOSE_SETTINGS / "control-plane.yaml"),
        "--pki",
        str(volumes / "pki"),
        "--certs",
        str(volumes / "certs"),
        "--tokens",
        str(volumes / "tokens"),
        "--devcerts",
        str(ROOT / "tools" / "devcerts.py"),
        "--user",
        f"{os.getuid()}:{os.getgid()}",
        *args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout


async def wait_until_available(api: str, model: str, providers: set[str]) -> None:
    """Poll the edge's catalog (its explicit readiness signal) until `providers` serve `model`."""
    async with aiohttp.ClientSession(api) as http, asyncio.timeout(60):
        while True:
            async with http.get("/iop/v1/catalog/models") as response:
                if response.status == 200:
                    entries = {entry["id"]: entry for entry in (await response.json())["data"]}
                    available = set(entries.get(model, {}).get("available_providers", []))
                    if providers <= available:
                        return
            await asyncio.sleep(0.2)


async def test_compose_files_run_with_certificates_and_tokens_from_iop_init(
    tmp_path: Path,
) -> None:
    volumes = tmp_path / "volumes"
    run_init(volumes, "--node", "node-a", "--node", "node-b")
    # The node host's files, unpacked from the bundle as deploy/README.md says.
    host = tmp_path / "node-host"
    with tarfile.open(fileobj=io.BytesIO(run_init(volumes, "--bundle", "node-b"))) as archive:
        archive.extractall(host, filter="data")

    certs = volumes / "certs"
    # Every listener binds port 0; each service names its ports in its ready line, and
    # the next one is told where to dial.
    admin = {"IOP_ADMIN__HOST": "127.0.0.1", "IOP_ADMIN__PORT": "0"}
    control_plane = {
        **tls(certs, "control-plane"),
        "IOP_FLEET_FILE": str(COMPOSE_SETTINGS / "fleet.yaml"),
        "IOP_DATABASE": str(volumes / "control-plane" / "credentials.db"),
        "IOP_LISTEN__HOST": "127.0.0.1",
        "IOP_LISTEN__PORT": "0",
    }

    def edge(cp_port: int) -> dict[str, str]:
        return {
            **tls(certs, "edge"),
            "IOP_HTTP__HOST": "127.0.0.1",
            "IOP_HTTP__PORT": "0",
            "IOP_NODE_LISTENER__HOST": "127.0.0.1",
            "IOP_NODE_LISTENER__PORT": "0",
            "IOP_CONTROL_PLANE__HOST": "127.0.0.1",
            "IOP_CONTROL_PLANE__PORT": str(cp_port),
            "IOP_CONTROL_PLANE__SERVER_NAME": "control-plane",
            "IOP_CONFIG_CACHE": str(volumes / "edge" / "fleet-config.pb"),
            "IOP_HISTORY_DB": str(volumes / "edge" / "runs.db"),
        }

    def nodes(node_port: int) -> list[tuple[Path, dict[str, str]]]:
        return [
            (
                COMPOSE_SETTINGS / "node-a.yaml",
                {
                    **tls(certs, "node-a"),
                    "IOP_EDGE__HOST": "127.0.0.1",
                    "IOP_EDGE__PORT": str(node_port),
                    "IOP_EDGE__SERVER_NAME": "edge",
                    "IOP_TOKEN_FILE": str(volumes / "tokens" / "node-a.token"),
                    "IOP_HISTORY_DB": str(volumes / "node-a" / "history.db"),
                },
            ),
            (
                NODE_HOST / "node.yaml",
                {
                    # docker-compose.node.yml's environment, with .env's values for this host
                    "IOP_SERVICE_ID": "node-b",
                    "IOP_EDGE__HOST": "127.0.0.1",
                    "IOP_EDGE__PORT": str(node_port),
                    "IOP_EDGE__SERVER_NAME": "edge",
                    # and its mounts
                    **tls(host / "certs", "node"),
                    "IOP_TOKEN_FILE": str(host / "node.token"),
                    "IOP_HISTORY_DB": str(tmp_path / "node-b" / "history.db"),
                },
            ),
        ]

    async with contextlib.AsyncExitStack() as stack:

        async def start(script: str, settings: Path, env: dict[str, str]) -> dict[str, int]:
            service = running_service(script, settings, env={**admin, **env})
            return (await stack.enter_async_context(service)).ports

        cp_settings = COMPOSE_SETTINGS / "control-plane.yaml"
        cp_ports = await start("iop-control-plane", cp_settings, control_plane)
        edge_settings = COMPOSE_SETTINGS / "edge.yaml"
        edge_ports = await start("iop-edge", edge_settings, edge(cp_ports["edges"]))
        for settings, env in nodes(edge_ports["nodes"]):
            await start("iop-node", settings, env)
        api = f"http://127.0.0.1:{edge_ports['http']}"
        await wait_until_available(api, "mock-small", {"node-a-mock", "node-b-mock"})
        async with AsyncOpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0) as client:
            completion = await client.chat.completions.create(
                model="mock-small",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=8,
            )
        assert completion.choices[0].message.content
        assert completion.usage is not None
        assert completion.usage.completion_tokens > 0
        async with aiohttp.ClientSession(api) as http, http.get("/iop/v1/runs") as response:
            runs: list[dict[str, Any]] = (await response.json())["data"]
        assert runs[0]["provider_id"] in {"node-a-mock", "node-b-mock"}
        assert runs[0]["outcome"] == "completed"


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service gets only its own IOP_* variables, and 127.0.0.1 is reached directly."""
    for name in [name for name in os.environ if name.startswith("IOP_")]:
        monkeypatch.delenv(name)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
