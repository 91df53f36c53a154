"""deploy/node-host/: the compose file of a host that runs only a node (and its provider).

Its per-host values come from `.env` (the operator copies `.env.example`); these tests
interpolate the compose file with `.env.example` as compose would, then load the mounted
node.yaml through the node's own settings loader with the environment the container gets.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from iop_edge.settings import EdgeSettings
from iop_node.settings import NodeSettings
from iop_proto.service import load_settings

ROOT = Path(__file__).resolve().parents[2]
HOST_DIR = ROOT / "deploy" / "node-host"
COMPOSE_FILE = HOST_DIR / "docker-compose.node.yml"
ENV_EXAMPLE = HOST_DIR / ".env.example"
SERVICE_UID = "10001"
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}; $$ is a literal $.
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


class MissingVariable(Exception):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution, enough for this file."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = env.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return value or ""

    return _VARIABLE.sub(substitute, text)


def env_example() -> dict[str, str]:
    """The uncommented KEY=VALUE lines of .env.example."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


@functools.cache
def rendered() -> dict[str, Any]:
    document = yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), env_example()))
    assert isinstance(document, dict)
    return document


def services() -> dict[str, dict[str, Any]]:
    found = rendered()["services"]
    assert isinstance(found, dict)
    return found


def volume_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Target -> (source, read_only), short syntax."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *options = volume.split(":")
        mounts[target] = (source, "ro" in options)
    return mounts


def host_path(source: str) -> Path:
    return (HOST_DIR / source).resolve()


def test_required_variables_fail_fast_without_env() -> None:
    """Without NODE_ID and EDGE_HOST compose refuses to start, naming the variable."""
    for name in ("NODE_ID", "EDGE_HOST"):
        env = {key: value for key, value in env_example().items() if key != name}
        with pytest.raises(MissingVariable, match=name):
            interpolate(COMPOSE_FILE.read_text(), env)


def test_the_node_is_built_from_the_repository_and_runs_as_the_images_user() -> None:
    node = services()["node"]
    assert host_path(node["build"]["context"]) == ROOT
    dockerfile = ROOT / node["build"]["dockerfile"]
    assert dockerfile == ROOT / "services" / "node" / "Dockerfile"
    assert dockerfile.is_file()
    assert node["image"] == "iop-node:latest"  # `make images` tags it; NODE_IMAGE_TAG pins one
    assert str(node.get("user", SERVICE_UID)).split(":")[0] == SERVICE_UID


def test_mounted_settings_load_with_the_containers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = services()["node"]
    mounts = volume_mounts(node)
    settings_source, read_only = mounts["/etc/iop/node.yaml"]
    assert read_only
    assert host_path(settings_source) == HOST_DIR / "node.yaml"
    for name in [name for name in os.environ if name.startswith("IOP_")]:
        monkeypatch.delenv(name)
    for name, value in node["environment"].items():
        assert name.startswith("IOP_"), name
        monkeypatch.setenv(name, str(value))
    settings = load_settings(NodeSettings, HOST_DIR / "node.yaml")
    example = env_example()
    assert settings.service_id == example["NODE_ID"]
    assert settings.edge.host == example["EDGE_HOST"]
    assert settings.edge.port == int(example["EDGE_PORT"])
    assert settings.edge.server_name == example["EDGE_SERVER_NAME"]
    # The files the operator places: the certificates directory and the token file.
    certs_source, certs_read_only = mounts["/certs"]
    assert certs_read_only
    assert host_path(certs_source) == HOST_DIR / "certs"
    for path in (settings.tls.ca_file, settings.tls.cert_file, settings.tls.key_file):
        assert path is not None
        assert PurePosixPath(path).parent == PurePosixPath("/certs")
    assert settings.token_file is not None
    token_source, token_read_only = mounts[str(settings.token_file)]
    assert token_read_only
    assert host_path(token_source) == HOST_DIR / "node.token"
    # Run history on the named volume.
    data_source, _ = mounts["/var/lib/iop/node"]
    assert data_source in rendered()["volumes"]
    assert PurePosixPath(settings.history_db).is_relative_to("/var/lib/iop/node")


def test_the_operators_files_are_kept_out_of_git() -> None:
    ignored = (HOST_DIR / ".gitignore").read_text().split()
    assert {".env", "certs/", "*.token", "*.tar"} <= set(ignored)


def test_the_edges_port_and_name_match_the_full_stack() -> None:
    """EDGE_PORT's default is the edge's node listener; EDGE_SERVER_NAME's a name it carries."""
    edge = EdgeSettings.model_validate(
        yaml.safe_load((ROOT / "deploy" / "compose" / "edge.yaml").read_text())
    )
    assert int(env_example()["EDGE_PORT"]) == edge.node_listener.port
    assert env_example()["EDGE_SERVER_NAME"] == edge.service_id  # devcerts: DNS:<identity>


def test_health_restart_and_start_order() -> None:
    found = services()
    node = found["node"]
    admin_port = yaml.safe_load((HOST_DIR / "node.yaml").read_text())["admin"]["port"]
    assert f"127.0.0.1:{admin_port}/healthz" in " ".join(node["healthcheck"]["test"])
    assert node["ports"] == [f"127.0.0.1:{admin_port}:{admin_port}"]
    # Each provider only when its profile is on: the node waits for those that start.
    assert node["depends_on"] == {
        "llamacpp": {"condition": "service_healthy", "required": False},
        "ollama": {"condition": "service_healthy", "required": False},
        "ollama-pull": {"condition": "service_completed_successfully", "required": False},
        "vllm": {"condition": "service_healthy", "required": False},
    }
    for name, service in found.items():
        if name == "ollama-pull":
            assert service["restart"] == "no"
        else:
            assert service["restart"] == "unless-stopped", name
            assert "healthcheck" in service, name
    devices = found["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_only_the_providers_asked_for_start() -> None:
    """One profile per provider (vLLM also under `gpu`, as in the full stack); the node has
    none, so `up` with no profile starts the node alone (its mock providers)."""
    profiles = {name: service.get("profiles") for name, service in services().items()}
    assert profiles == {
        "node": None,
        "llamacpp": ["llamacpp"],
        "ollama": ["ollama"],
        "ollama-pull": ["ollama"],
        "vllm": ["vllm", "gpu"],
    }
