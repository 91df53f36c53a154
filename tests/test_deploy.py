"""The compose stack: docker-compose.yml and what it mounts from deploy/compose/.

No Docker engine runs on the development machines or in CI, so these tests read the files and
check them against the repository and each other: build contexts, named volumes, the init
service, settings models, the fleet file, start order, health checks and restart policies.
`docker compose config` runs only where `docker info` works. Elsewhere: the images and
`make images` in tests/deploy/test_images.py, the compose schema, the node-host compose file
and the init program in tests/deploy/, the real containers in tests/containers/.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel

from iop_control_plane.adapters.fleet_file import load_fleet_file
from iop_control_plane.settings import ControlPlaneSettings
from iop_edge.settings import EdgeSettings
from iop_node.settings import NodeSettings
from iop_proto.service import load_settings
from iop_worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
INIT_DOCKERFILE = ROOT / "deploy" / "init" / "Dockerfile"
FLEET_FILE = ROOT / "deploy" / "compose" / "fleet.yaml"
SERVICE_UID = "10001"
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
    "node-gpu": "node",
    "worker": "worker",
}
NODES = sorted(name for name, service in IDENTITIES.items() if service == "node")
ONE_SHOTS = {"iop-init", "llamacpp-model", "ollama-pull"}  # run to completion, then exit 0
PROVIDERS = {"llamacpp", "llamacpp-upstream", "ollama", "vllm"}
HA = {"postgres", "edge-1", "edge-2", "haproxy"}  # `--profile ha`: two edges on one PostgreSQL
OBSERVABILITY = {"prometheus", "grafana"}  # `--profile observability`: what watches the stack
OBSERVABILITY_FILES = {"prometheus", "grafana"}  # deploy/<dir>: their settings, mounted read-only
HA_EDGES = (
    "edge-1",
    "edge-2",
)  # edges with the edge identity's certificate and settings of their own
START_ORDER = {  # compose service -> the services it waits for (healthy, or completed)
    "control-plane": {"iop-init"},
    "edge": {"iop-init", "control-plane"},
    "node-a": {"iop-init", "edge", "llamacpp"},
    "node-b": {"iop-init", "edge", "ollama", "ollama-pull"},
    "node-gpu": {"iop-init", "edge", "vllm"},
    "worker": {"iop-init", "edge"},
    "llamacpp-upstream": {"llamacpp-model"},
    "ollama-pull": {"ollama"},
    "edge-1": {"iop-init", "control-plane", "postgres"},
    "edge-2": {"iop-init", "control-plane", "postgres"},
    "haproxy": {"edge-1", "edge-2"},
    "grafana": {"prometheus"},
}
PROFILES = {  # compose service -> its profiles; every other service starts with a plain `up`
    "node-gpu": ["gpu"],
    "vllm": ["gpu"],
    "node-b": ["ollama"],
    "ollama": ["ollama"],
    "ollama-pull": ["ollama"],
    "llamacpp-model": ["llamacpp-upstream"],
    "llamacpp-upstream": ["llamacpp-upstream"],
    **{name: ["ha"] for name in HA},
    **{name: ["observability"] for name in OBSERVABILITY},
}
DEV_REFERENCE = {"node-gpu": "node-a"}  # configs/dev/ has no GPU node: compare with node-a's keys

# --- helpers ---------------------------------------------------------------------------------


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
    return source.startswith((".", "/", "~", "$"))


def mounted_file(service: dict[str, Any], target: str) -> Path:
    """The repository file bind-mounted at `target`."""
    sources = [src for src, tgt, _ in volume_mounts(service) if tgt == target and is_host_path(src)]
    assert len(sources) == 1, f"nothing (or several) mounted at {target}"
    return ROOT / PurePosixPath(sources[0]).relative_to(".")


def admin_port_of_healthcheck(test: list[str]) -> int:
    match = re.search(r"127\.0\.0\.1:(\d+)/healthz", " ".join(test))
    assert match, f"healthcheck does not GET 127.0.0.1:<port>/healthz: {test}"
    return int(match.group(1))


def option(command: list[str], name: str) -> str:
    """The value following `name` in an argument list."""
    assert name in command, f"{name} not in {command}"
    return command[command.index(name) + 1]


def published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> the host side of its short-syntax mapping (`[ip:]port`)."""
    mappings = {}
    for entry in service.get("ports", []):
        host, _, target = str(entry).rpartition(":")
        mappings[int(target)] = host
    return mappings


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


# --- docker-compose.yml: services, images, volumes -------------------------------------------


def test_compose_file_has_the_stack_and_no_version_key() -> None:
    assert "version" not in compose()
    assert set(compose_services()) == set(IDENTITIES) | ONE_SHOTS | PROVIDERS | HA | OBSERVABILITY


@pytest.mark.parametrize("identity", [*sorted(IDENTITIES), "iop-init"])
def test_compose_builds_each_service_from_its_dockerfile(identity: str) -> None:
    service = compose_services()[identity]
    build = service["build"]
    context = ROOT / build["context"]
    assert context.resolve() == ROOT
    dockerfile_path = context / build["dockerfile"]
    assert dockerfile_path.is_file()
    name = IDENTITIES.get(identity, "init")
    expected = INIT_DOCKERFILE if name == "init" else ROOT / "services" / name / "Dockerfile"
    assert dockerfile_path.resolve() == expected
    assert service["image"] == f"iop-{name}:latest"  # the tag `make images` also gives


def test_compose_mounts_named_volumes_and_only_settings_files_from_the_host() -> None:
    """No host directory: certificates, tokens and SQLite files all live in named volumes."""
    declared = set(compose().get("volumes") or {})
    used = set()
    for name, service in compose_services().items():
        for source, _target, read_only in volume_mounts(service):
            if not is_host_path(source):
                assert source in declared, f"{name}: undeclared volume {source}"
                used.add(source)
                continue
            path = ROOT / PurePosixPath(source).relative_to(".")
            assert read_only, f"{name}: {source} must be mounted read-only"
            if name in OBSERVABILITY:  # its rules and dashboards: files or folders of them
                assert path.exists(), f"{name}: {source} is not in the repository"
                assert path.relative_to(ROOT / "deploy").parts[0] in OBSERVABILITY_FILES, source
                continue
            assert path.is_file(), f"{name}: {source} is not a file of the repository"
            assert path.parent in {ROOT / "deploy" / "compose"}, f"{name}: {source}"
    assert used == declared, f"declared but unused: {declared - used}"


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_mounts_certificates_and_settings_read_only(identity: str) -> None:
    mounts = volume_mounts(compose_services()[identity])
    settings_file = f"./deploy/compose/{identity}.yaml"
    assert ("certs", "/certs", True) in mounts
    assert (settings_file, f"/etc/iop/{IDENTITIES[identity]}.yaml", True) in mounts


@pytest.mark.parametrize("node", NODES)
def test_compose_nodes_read_their_token_from_the_tokens_volume(node: str) -> None:
    assert ("tokens", "/etc/iop/tokens", True) in volume_mounts(compose_services()[node])
    assert settings_yaml(node)["token_file"] == f"/etc/iop/tokens/{node}.token"


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_state_files_are_on_named_volumes(identity: str) -> None:
    """Every SQLite file and cache a service writes is inside one of its named volumes."""
    settings = SETTINGS_MODELS[IDENTITIES[identity]].model_validate(settings_yaml(identity))
    volumes = [
        PurePosixPath(target)
        for source, target, read_only in volume_mounts(compose_services()[identity])
        if not is_host_path(source) and not read_only
    ]
    state = [
        PurePosixPath(value)
        for field in ("database", "history_db", "responses_db", "config_cache")
        if (value := getattr(settings, field, None)) is not None
    ]
    for path in state:
        assert any(path.is_relative_to(volume) for volume in volumes), f"{identity}: {path}"


def test_compose_init_service_creates_certificates_and_tokens() -> None:
    services = compose_services()
    init = services["iop-init"]
    assert str(init["user"]) == "0:0"  # to give fresh volumes to uid 10001; it drops to it
    command = init["command"]
    nodes = [command[i + 1] for i, word in enumerate(command) if word == "--node"]
    assert sorted(nodes) == NODES
    fleet_nodes = {node.id for node in load_fleet_file(FLEET_FILE).spec.nodes}
    assert set(nodes) == fleet_nodes
    mounts = {target: (source, ro) for source, target, ro in volume_mounts(init)}
    assert mounts["/certs"] == ("certs", False)
    assert mounts["/tokens"] == ("tokens", False)
    assert mounts["/var/lib/iop/pki"] == ("pki", False)
    # It issues tokens into the control-plane's own database: same settings, same volume.
    control_plane = services["control-plane"]
    assert mounted_file(init, "/etc/iop/control-plane.yaml") == mounted_file(
        control_plane, "/etc/iop/control-plane.yaml"
    )
    database = PurePosixPath(settings_yaml("control-plane")["database"])
    init_volume = mounts[str(database.parent)][0]
    assert (init_volume, str(database.parent), False) in volume_mounts(control_plane)
    # The CA key stays in the init's volume.
    for name, service in services.items():
        if name != "iop-init":
            assert "pki" not in {source for source, _, _ in volume_mounts(service)}, name


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_settings_file_validates_against_the_service_model(identity: str) -> None:
    data = settings_yaml(identity)
    settings = SETTINGS_MODELS[IDENTITIES[identity]].model_validate(data)
    dumped = settings.model_dump()
    assert dumped["service_id"] == identity  # = the certificate identity = the compose name
    assert dumped["admin"]["host"] == "0.0.0.0"
    assert dumped["tls"]["enabled"] is True
    assert dumped["tls"]["ca_file"] == Path("/certs/ca.pem")
    assert dumped["tls"]["cert_file"] == Path(f"/certs/{identity}.pem")
    assert dumped["tls"]["key_file"] == Path(f"/certs/{identity}.key")
    # The same keys as the `make run` settings, with only hosts and paths changed.
    reference = DEV_REFERENCE.get(identity, identity)
    dev = yaml.safe_load((ROOT / "configs" / "dev" / f"{reference}.yaml").read_text())
    assert set(data) == set(dev)
    if reference == identity:
        assert data["admin"]["port"] == dev["admin"]["port"]


def test_compose_admin_ports_are_distinct() -> None:
    ports = [settings_yaml(identity)["admin"]["port"] for identity in IDENTITIES]
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_mounted_settings_load_with_the_services_environment(
    identity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the service itself does at start: the file plus its IOP_* environment."""
    service = compose_services()[identity]
    for name in [name for name in os.environ if name.startswith("IOP_")]:
        monkeypatch.delenv(name)
    for name, value in (service.get("environment") or {}).items():
        monkeypatch.setenv(name, str(value))
    path = mounted_file(service, f"/etc/iop/{IDENTITIES[identity]}.yaml")
    settings = load_settings(SETTINGS_MODELS[IDENTITIES[identity]], path)
    assert settings.model_dump()["service_id"] == identity


def test_compose_fleet_file_is_mounted_and_valid() -> None:
    """The fleet the control-plane reads passes the control-plane's own validation."""
    control_plane = compose_services()["control-plane"]
    fleet_target = settings_yaml("control-plane")["fleet_file"]
    assert mounted_file(control_plane, fleet_target) == FLEET_FILE
    parsed = load_fleet_file(FLEET_FILE)
    assert parsed.warnings == []
    models = {model.id: dict(model.providers) for model in parsed.spec.models}
    assert set(models["mock-small"]) == {"node-a-mock", "node-b-mock"}
    assert set(models["smollm2:135m"]) == {"node-a-llamacpp", "node-b-ollama"}
    assert set(models["qwen2.5:0.5b"]) == {"node-gpu-vllm"}


# --- docker-compose.yml: start order, health, restarts ---------------------------------------


def test_compose_depends_on_follows_the_start_order() -> None:
    services = compose_services()
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions"
        for dependency, spec in depends_on.items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if dependency in ONE_SHOTS:
                assert spec["condition"] == "service_completed_successfully", name
            else:
                assert spec["condition"] == "service_healthy", name
                assert "healthcheck" in services[dependency], dependency
            if "profiles" not in service:
                assert "profiles" not in services[dependency], "the default profile starts alone"
        assert set(depends_on) == START_ORDER.get(name, set()), name

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency, (*path, name))

    for name in services:
        visit(name, ())


def test_compose_long_running_services_have_healthchecks_and_restart() -> None:
    for name, service in compose_services().items():
        if name in ONE_SHOTS:
            assert service["restart"] == "no", name
            assert "healthcheck" not in service, name
        else:
            assert service["restart"] == "unless-stopped", name
            assert service["healthcheck"]["test"][0] == "CMD", name


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_compose_healthcheck_probes_the_admin_port_of_the_settings(identity: str) -> None:
    healthcheck = compose_services()[identity]["healthcheck"]
    assert (
        admin_port_of_healthcheck(healthcheck["test"]) == settings_yaml(identity)["admin"]["port"]
    )


def test_compose_profiles_keep_every_registry_image_out_of_a_plain_up() -> None:
    """`docker compose up` with no profile runs only images this repository builds (each with
    a `build:`): no registry, no model hub. Each upstream provider image has its profile."""
    for name, service in compose_services().items():
        assert service.get("profiles", []) == PROFILES.get(name, []), name
        if name not in PROFILES:
            assert "build" in service, name
            assert service["image"].startswith("iop-"), name


def test_compose_only_the_init_runs_as_root() -> None:
    for name, service in compose_services().items():
        if name == "iop-init" or name not in IDENTITIES:
            continue
        user = str(service.get("user", SERVICE_UID))  # the images' USER
        assert user.split(":")[0] == SERVICE_UID, name


def test_compose_edge_publishes_the_api_the_node_listener_and_its_admin_port() -> None:
    ports = published(compose_services()["edge"])
    edge = settings_yaml("edge")
    assert set(ports) == {edge["http"]["port"], edge["node_listener"]["port"], 9101}
    assert ports[edge["admin"]["port"]].startswith("127.0.0.1:"), "admin: this host only"
    assert not ports[edge["http"]["port"]].startswith("127.0.0.1:")
    assert not ports[edge["node_listener"]["port"]].startswith("127.0.0.1:")


# --- docker-compose.yml: providers and the fleet ---------------------------------------------


def provider_ports() -> dict[str, int]:
    """Compose provider service -> the port it serves on inside the compose network."""
    services = compose_services()
    return {
        "llamacpp": int(option(services["llamacpp"]["command"], "--port")),
        "ollama": 11434,  # the image's default (OLLAMA_HOST=0.0.0.0:11434)
        "vllm": 8000,  # vllm serve's default
    }


def test_fleet_endpoints_are_compose_providers_that_the_node_waits_for() -> None:
    services = compose_services()
    ports = provider_ports()
    endpoints = 0
    for node in load_fleet_file(FLEET_FILE).spec.nodes:
        for provider in node.providers:
            if provider.endpoint is None:
                continue
            endpoints += 1
            url = urlsplit(provider.endpoint)
            assert url.hostname in PROVIDERS, provider.id
            assert url.port == ports[url.hostname], provider.id
            assert url.hostname in services[node.id]["depends_on"], (node.id, url.hostname)
            same_profiles = services[node.id].get("profiles") == services[url.hostname].get(
                "profiles"
            )
            assert same_profiles, (node.id, url.hostname)
    assert endpoints == len(PROVIDERS - {"llamacpp-upstream"})  # an alternative, in no fleet


def fleet_provider(provider_id: str) -> Any:
    for node in load_fleet_file(FLEET_FILE).spec.nodes:
        for provider in node.providers:
            if provider.id == provider_id:
                return provider
    raise AssertionError(f"no provider {provider_id} in {FLEET_FILE}")


def test_llamacpp_serves_the_fleets_name_from_its_image_or_the_fetched_model() -> None:
    """node-a's provider is the iop-llamacpp image (the model inside); llamacpp-upstream, the
    upstream image under its profile, serves the same model by the same name from the
    llamacpp-model one-shot's volume."""
    services = compose_services()
    provider = fleet_provider("node-a-llamacpp")
    assert provider.endpoint == "http://llamacpp:8080"
    ours, upstream = services["llamacpp"], services["llamacpp-upstream"]
    assert ours["build"]["dockerfile"] == "deploy/llamacpp/Dockerfile"
    assert upstream["image"].startswith("ghcr.io/ggml-org/llama.cpp:server")
    for llamacpp in (ours, upstream):
        command = llamacpp["command"]
        assert list(provider.models) == [option(command, "--alias")]
        assert provider.capacity == int(option(command, "--parallel"))
        assert option(command, "--host") == "0.0.0.0"
        assert option(command, "--port") == "8080"
    # The model file is the one the llamacpp-model one-shot writes into the shared volume.
    llamacpp = upstream
    model = PurePosixPath(option(upstream["command"], "--model"))
    fetch = services["llamacpp-model"]
    script = mounted_file(fetch, fetch["command"][-1])
    assert f"MODEL={model.name}\n" in script.read_text()
    models_dir = fetch["environment"]["MODELS_DIR"]
    model_volume = {t: s for s, t, _ in volume_mounts(fetch)}[models_dir]
    assert (model_volume, str(model.parent), True) in volume_mounts(llamacpp)


def test_ollama_pulls_the_fleets_name() -> None:
    services = compose_services()
    ollama, pull = services["ollama"], services["ollama-pull"]
    assert ollama["image"].startswith("ollama/ollama")
    assert pull["image"] == ollama["image"]
    assert list(fleet_provider("node-b-ollama").models) == ["smollm2:135m"]
    assert pull["environment"]["PULL_MODEL"] == "smollm2:135m"
    assert pull["environment"]["OLLAMA_HOST"] == "http://ollama:11434"
    assert "ollama pull" in " ".join(pull["entrypoint"])
    mounts = volume_mounts(ollama)
    assert any(target == "/root/.ollama" and not is_host_path(src) for src, target, _ in mounts)


def test_vllm_is_a_gpu_profile_with_a_device_reservation_serving_the_fleets_name() -> None:
    vllm = compose_services()["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai")
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert list(fleet_provider("node-gpu-vllm").models) == [option(vllm["command"], "--model")]


# --- with a Docker engine only ---------------------------------------------------------------


@pytest.mark.slow
def test_docker_compose_config_renders() -> None:
    # `make test-containers` (TEST_CONTAINERS_REQUIRED=1) runs this one too: no skip there.
    unavailable = pytest.fail if os.environ.get("TEST_CONTAINERS_REQUIRED") == "1" else pytest.skip
    docker = docker_engine()
    if docker is None:
        unavailable(NO_ENGINE)
    assert docker is not None
    plugin = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
    if plugin.returncode != 0:
        unavailable("the docker CLI has no compose plugin")
    node_host = ROOT / "deploy" / "node-host" / "docker-compose.node.yml"
    # The node host's required variables, as its .env would set them.
    env = {**os.environ, "NODE_ID": "node-c", "EDGE_HOST": "edge.example.com"}
    for path in (COMPOSE_FILE, node_host):
        for profile in ([], ["--profile", "*"]):
            result = subprocess.run(
                [docker, "compose", "--file", str(path), *profile, "config", "--quiet"],
                cwd=path.parent,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, f"{path.name} {profile}: {result.stderr}"


# --- docker-compose.yml: `--profile ha` -------------------------------------------------------


@pytest.mark.parametrize("edge", HA_EDGES)
def test_compose_ha_edges_are_the_edge_with_a_shared_store_and_files_of_their_own(
    edge: str,
) -> None:
    """Each HA edge: the edge image, edge.yaml's settings plus the postgres section naming the
    postgres service, its own service id and volume, the edge identity's certificate."""
    service = compose_services()[edge]
    assert service["build"]["dockerfile"] == "services/edge/Dockerfile"
    assert service["image"] == "iop-edge:latest"
    assert "user" not in service  # the image's uid 10001
    data = settings_yaml(edge)
    settings = EdgeSettings.model_validate(data)
    assert settings.service_id == edge
    assert settings.postgres is not None
    dsn = urlsplit(settings.postgres.dsn.get_secret_value())
    assert (dsn.hostname, dsn.port, dsn.path) == ("postgres", 5432, "/iop")
    # Listed to the nodes and the worker at its compose name, checked against the edge
    # identity's certificate (DNS:edge), which it presents.
    assert settings.node_listener.advertised(7000) == (edge, 7000)
    assert settings.node_listener.advertise_server_name == "edge"
    assert settings.tls.cert_file == Path("/certs/edge.pem")
    plain = settings_yaml("edge")
    ours = {"service_id", "postgres", "node_listener"}
    assert {k: v for k, v in data.items() if k not in ours} == {
        k: v for k, v in plain.items() if k not in ours
    }
    mounts = volume_mounts(service)
    assert ("certs", "/certs", True) in mounts
    assert (f"./deploy/compose/{edge}.yaml", "/etc/iop/edge.yaml", True) in mounts
    assert (f"{edge}-data", "/var/lib/iop/edge", False) in mounts
    assert admin_port_of_healthcheck(service["healthcheck"]["test"]) == data["admin"]["port"]


def test_compose_haproxy_balances_over_the_ha_edges_api_checking_their_admin_port() -> None:
    services = compose_services()
    haproxy = services["haproxy"]
    assert haproxy["build"]["dockerfile"] == "deploy/haproxy/Dockerfile"
    config = mounted_file(haproxy, "/etc/haproxy/haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server (\S+) (\S+):(\d+)", config, re.MULTILINE)
    assert servers == [(edge, edge, str(settings_yaml(edge)["http"]["port"])) for edge in HA_EDGES]
    check_port = re.search(r"default-server check port (\d+)", config)
    assert check_port is not None
    assert {int(check_port.group(1))} == {settings_yaml(edge)["admin"]["port"] for edge in HA_EDGES}
    assert "option redispatch" in config  # a refused connection goes to the other edge
    ports = published(haproxy)
    assert list(ports) == [8080]
    assert not ports[8080].startswith("127.0.0.1:")
    health = re.search(r"bind :(\d+)\s+monitor-uri (\S+)", config)
    assert health is not None
    assert f"127.0.0.1:{health.group(1)}{health.group(2)}" in " ".join(
        haproxy["healthcheck"]["test"]
    )


def test_compose_postgres_is_built_here_keeps_its_data_in_a_volume_and_is_not_published() -> None:
    postgres = compose_services()["postgres"]
    assert postgres["build"]["dockerfile"] == "deploy/postgres/Dockerfile"
    assert postgres["image"] == "iop-postgres:latest"
    assert ("postgres-data", "/var/lib/postgresql/data", False) in volume_mounts(postgres)
    assert "ports" not in postgres  # only the edges on the compose network reach it
    dockerfile = (ROOT / "deploy" / "postgres" / "Dockerfile").read_text()
    assert "postgresql-15" in dockerfile  # Debian's server, the version the tests run
    assert (ROOT / "deploy" / "postgres" / "entrypoint.sh").is_file()


def test_haproxy_accepts_the_compose_config() -> None:
    """HAProxy's own check of deploy/compose/haproxy.cfg, where Debian's haproxy is installed
    (the edges' names need not resolve for `-c`: checked with them as local addresses)."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    config = (ROOT / "deploy" / "compose" / "haproxy.cfg").read_text()
    for edge in HA_EDGES:
        config = config.replace(f" {edge}:", " 127.0.0.1:")
    result = subprocess.run(
        [haproxy, "-c", "-f", "/dev/stdin"],
        input=config,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
