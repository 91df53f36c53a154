"""The container deployment: services/*/Dockerfile, .dockerignore, docker-compose.yml, deploy/.

No Docker engine runs on the development machines or in CI, so most of these tests read the
files and check them against the repository (paths, console scripts, settings models). The
tests that render the compose file and build the images run only where `docker info` works.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from iop_control_plane.settings import ControlPlaneSettings
from iop_edge.settings import EdgeSettings
from iop_node.settings import NodeSettings
from iop_worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
BASE_IMAGE = "python:3.11-slim"
# Made on the host, never committed: certificates (`make certs`) and node tokens
# (deploy/README.md).
GENERATED = {PurePosixPath("certs/dev"), PurePosixPath("var/compose/tokens")}
NO_ENGINE = "no Docker engine on this machine"

SETTINGS_MODELS: dict[str, type[BaseModel]] = {  # services/<name> -> its settings model
    "control-plane": ControlPlaneSettings,
    "edge": EdgeSettings,
    "node": NodeSettings,
    "worker": WorkerSettings,
}
IDENTITIES = {  # compose service = certificate identity -> services/<name>
    "control-plane": "control-plane",
    "edge": "edge",
    "node-a": "node",
    "node-b": "node",
    "worker": "worker",
}
START_ORDER = {  # compose service -> the services it must wait for (healthy)
    "control-plane": set(),
    "edge": {"control-plane"},
    "node-a": {"edge"},
    "node-b": {"edge", "ollama"},
    "worker": {"edge"},
}

# --- helpers ---------------------------------------------------------------------------------


def pyproject(name: str) -> dict[str, Any]:
    with (ROOT / "services" / name / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of services/<name>/Dockerfile, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "services" / name / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and the syntax directive; also allowed inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, f"services/{name}/Dockerfile ends inside a continuation line"
    return instructions


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list), f"not the exec (JSON) form: {arguments}"
    return [str(item) for item in value]


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the root) out of the build context.

    Docker's rules, enough for the patterns used here: a pattern matches a path or any of its
    parent directories, `**/` matches any number of leading directories, `!` re-includes and
    the last matching pattern wins.
    """
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:end]) for end in range(1, len(parts) + 1)]
    ignored = False
    for pattern in dockerignore_patterns():
        negate = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        for prefix in prefixes:
            names = {prefix}
            if glob.startswith("**/"):
                names |= {"/".join(prefix.split("/")[start:]) for start in range(len(parts))}
                glob_here = glob[3:]
            else:
                glob_here = glob
            if any(fnmatchcase(name, glob_here) for name in names):
                ignored = not negate
                break
    return ignored


@functools.cache
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(document, dict)
    return document


def compose_services() -> dict[str, dict[str, Any]]:
    services = compose()["services"]
    assert isinstance(services, dict)
    return services


def settings_yaml(identity: str) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "deploy" / "compose" / f"{identity}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of each volume, short or long syntax."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *options = volume.split(":")
            mounts.append((source, target, "ro" in options))
        else:
            mounts.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
    return mounts


def is_host_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def admin_port_of_healthcheck(test: list[str]) -> int:
    match = re.search(r"127\.0\.0\.1:(\d+)/healthz", " ".join(test))
    assert match, f"healthcheck does not GET 127.0.0.1:<port>/healthz: {test}"
    return int(match.group(1))


@functools.cache
def docker_engine() -> str | None:
    """The docker CLI when a Docker engine answers it, else None."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        info = subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return docker if info.returncode == 0 else None


# --- Dockerfiles -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_dockerfile_is_multi_stage_on_python_slim(name: str) -> None:
    instructions = dockerfile(name)
    stages = [arguments.split() for keyword, arguments in instructions if keyword == "FROM"]
    assert len(stages) >= 2, "a builder stage and a final stage"
    assert all(stage[0] == BASE_IMAGE for stage in stages), stages
    build_steps = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    assert "./proto" in build_steps
    assert f"./services/{name}" in build_steps


@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_dockerfile_copies_only_existing_paths_of_proto_and_its_service(name: str) -> None:
    stage_names = {
        arguments.split()[-1]
        for keyword, arguments in dockerfile(name)
        if keyword == "FROM" and " as " in arguments.lower()
    }
    copies = [arguments for keyword, arguments in dockerfile(name) if keyword in {"COPY", "ADD"}]
    assert copies
    for arguments in copies:
        words = shlex.split(arguments)
        flags = [word for word in words if word.startswith("--")]
        if any(flag.startswith("--from=") for flag in flags):
            assert {flag.split("=", 1)[1] for flag in flags if "--from=" in flag} <= stage_names
            continue
        paths = [word for word in words if not word.startswith("--")]
        for source in paths[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert source.startswith(("proto/", f"services/{name}/")), source
            assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"


@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_dockerfile_runs_as_a_non_root_user(name: str) -> None:
    users = [arguments for keyword, arguments in final_stage(dockerfile(name)) if keyword == "USER"]
    assert users, "the final stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert "--uid 10001" in " ".join(a for k, a in final_stage(dockerfile(name)) if k == "RUN")


@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_dockerfile_entrypoint_is_the_services_console_script(name: str) -> None:
    stage = final_stage(dockerfile(name))
    entrypoints = [exec_form(arguments) for keyword, arguments in stage if keyword == "ENTRYPOINT"]
    commands = [exec_form(arguments) for keyword, arguments in stage if keyword == "CMD"]
    assert entrypoints[-1] == [f"iop-{name}"]
    assert f"iop-{name}" in pyproject(name)["project"]["scripts"]
    assert commands[-1] == ["--config", f"/etc/iop/{name}.yaml"]


@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_dockerfile_healthcheck_gets_healthz_on_an_exposed_port(name: str) -> None:
    stage = final_stage(dockerfile(name))
    checks = [arguments for keyword, arguments in stage if keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    probe = checks[0]
    assert "urllib.request" in probe
    assert "/healthz" in probe
    # The port comes from IOP_ADMIN__PORT (the settings override of admin.port) or a default.
    match = re.search(r"os\.environ\.get\('IOP_ADMIN__PORT', '(\d+)'\)", probe)
    assert match, probe
    exposed = {port for k, a in stage if k == "EXPOSE" for port in a.split()}
    assert match.group(1) in exposed
    reference = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    assert int(match.group(1)) == reference["admin"]["port"]


@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_dockerfile_environment_and_labels(name: str) -> None:
    stage = final_stage(dockerfile(name))
    environment = " ".join(arguments for keyword, arguments in stage if keyword == "ENV")
    assert "PYTHONUNBUFFERED=1" in environment.split()
    version_args = [a for k, a in stage if k == "ARG" and a.startswith("VERSION=")]
    assert version_args == [f"VERSION={pyproject(name)['project']['version']}"]
    labels = " ".join(arguments for keyword, arguments in stage if keyword == "LABEL")
    assert f'org.opencontainers.image.title="iop-{name}"' in labels
    assert 'org.opencontainers.image.version="${VERSION}"' in labels


def test_dockerignore_keeps_secrets_environments_and_tests_out() -> None:
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        "certs/dev/ca.key",
        "certs/dev/edge.pem",
        "var/devstack/edge.log",
        "test-artifacts/report.xml",
        "tests/test_deploy.py",
        "proto/tests/test_framing.py",
        "services/edge/tests/unit/test_settings.py",
        "services/edge/src/iop_edge/__pycache__/settings.cpython-311.pyc",
        ".pytest_cache/v/cache/nodeids",
        ".ruff_cache/CACHEDIR.TAG",
        ".mypy_cache/3.11/cache.db",
    ]:
        assert dockerignored(path), path
    for path in [
        "proto/pyproject.toml",
        "proto/src/iop_proto/v1/runtime_pb2.py",
        "services/edge/src/iop_edge/settings.py",
    ]:
        assert not dockerignored(path), path


# --- docker-compose.yml ----------------------------------------------------------------------


def test_compose_file_has_the_stack_and_no_version_key() -> None:
    assert "version" not in compose()
    assert set(compose_services()) == set(IDENTITIES) | {"ollama", "vllm"}


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_builds_each_service_from_its_dockerfile(identity: str) -> None:
    build = compose_services()[identity]["build"]
    context = ROOT / build["context"]
    assert context.resolve() == ROOT
    dockerfile_path = context / build["dockerfile"]
    assert dockerfile_path.is_file()
    assert dockerfile_path.resolve() == ROOT / "services" / IDENTITIES[identity] / "Dockerfile"


def test_compose_mounts_exist_or_are_generated() -> None:
    declared_volumes = set(compose().get("volumes") or {})
    for name, service in compose_services().items():
        for source, _target, _read_only in volume_mounts(service):
            if not is_host_path(source):
                assert source in declared_volumes, f"{name}: undeclared volume {source}"
                continue
            relative = PurePosixPath(source).relative_to(".")
            assert (ROOT / relative).exists() or relative in GENERATED, f"{name}: {source}"


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_mounts_certificates_and_settings_read_only(identity: str) -> None:
    mounts = volume_mounts(compose_services()[identity])
    settings_file = f"./deploy/compose/{identity}.yaml"
    assert ("./certs/dev", "/certs", True) in mounts
    assert (settings_file, f"/etc/iop/{IDENTITIES[identity]}.yaml", True) in mounts


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_settings_file_validates_against_the_service_model(identity: str) -> None:
    data = settings_yaml(identity)
    # Validation checks the shape and values only; the certificate files are not read.
    settings = SETTINGS_MODELS[IDENTITIES[identity]].model_validate(data)
    dumped = settings.model_dump()
    assert dumped["service_id"] == identity  # = the certificate identity = the compose name
    assert dumped["admin"]["host"] == "0.0.0.0"
    assert dumped["tls"]["enabled"] is True
    assert dumped["tls"]["ca_file"] == Path("/certs/ca.pem")
    assert dumped["tls"]["cert_file"] == Path(f"/certs/{identity}.pem")
    assert dumped["tls"]["key_file"] == Path(f"/certs/{identity}.key")
    # The same keys as the `make run` settings, with only host and certificate paths changed.
    dev = yaml.safe_load((ROOT / "configs" / "dev" / f"{identity}.yaml").read_text())
    assert set(data) == set(dev)
    assert data["admin"]["port"] == dev["admin"]["port"]


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_healthcheck_probes_the_admin_port_of_the_settings(identity: str) -> None:
    healthcheck = compose_services()[identity]["healthcheck"]
    assert (
        admin_port_of_healthcheck(healthcheck["test"]) == settings_yaml(identity)["admin"]["port"]
    )


def test_compose_depends_on_follows_the_start_order() -> None:
    services = compose_services()
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions"
        for dependency, spec in depends_on.items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert spec["condition"] == "service_healthy"
            assert "healthcheck" in services[dependency], dependency
            assert "profiles" not in services[dependency], "the default profile starts alone"
        if name in START_ORDER:
            assert set(depends_on) == START_ORDER[name], name

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency, (*path, name))

    for name in services:
        visit(name, ())


def test_compose_services_run_as_non_root() -> None:
    for identity in IDENTITIES:
        user = str(compose_services()[identity].get("user", "10001"))
        assert user.split(":")[0] not in {"root", "0"}, identity


def test_compose_edge_publishes_the_api_and_its_admin_port() -> None:
    ports = [str(port) for port in compose_services()["edge"]["ports"]]
    admin_port = settings_yaml("edge")["admin"]["port"]
    assert any(port.endswith("8080:8080") for port in ports), ports
    assert any(port.endswith(f"{admin_port}:{admin_port}") for port in ports), ports


def test_compose_ollama_is_node_b_provider() -> None:
    services = compose_services()
    ollama = services["ollama"]
    assert ollama["image"].startswith("ollama/ollama")
    assert "healthcheck" in ollama
    mounts = volume_mounts(ollama)
    assert any(target == "/root/.ollama" and not is_host_path(src) for src, target, _ in mounts)
    assert services["node-b"]["environment"]["OLLAMA_HOST"] == "http://ollama:11434"
    assert "ollama" in services["node-b"]["depends_on"]


def test_compose_vllm_is_a_gpu_profile_with_a_device_reservation() -> None:
    vllm = compose_services()["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai")
    assert vllm["profiles"] == ["gpu"]
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "--model" in vllm["command"]
    assert "healthcheck" in vllm


# --- with a Docker engine only ---------------------------------------------------------------


@pytest.mark.slow
def test_docker_compose_config_renders() -> None:
    docker = docker_engine()
    if docker is None:
        pytest.skip(NO_ENGINE)
    plugin = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
    if plugin.returncode != 0:
        pytest.skip("the docker CLI has no compose plugin")
    result = subprocess.run(
        [docker, "compose", "--file", str(COMPOSE_FILE), "config", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", sorted(SETTINGS_MODELS))
def test_docker_build(name: str) -> None:
    docker = docker_engine()
    if docker is None:
        pytest.skip(NO_ENGINE)
    dockerfile_path = f"services/{name}/Dockerfile"
    command = [docker, "build", "--file", dockerfile_path, "--tag", f"iop-{name}:test", "."]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert result.returncode == 0, result.stderr[-4000:]


def test_compose_fleet_file_is_valid() -> None:
    """The fleet the compose stack mounts passes the control-plane's own validation."""
    from iop_control_plane.adapters.fleet_file import load_fleet_file

    parsed = load_fleet_file(ROOT / "deploy" / "compose" / "fleet.yaml")
    assert parsed.warnings == []
    endpoints = {provider.endpoint for node in parsed.spec.nodes for provider in node.providers}
    assert {"http://ollama:11434", "http://vllm:8000"} <= endpoints
