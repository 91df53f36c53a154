"""docker-compose.yml for real: the whole stack up, a chat through it, a remote node host, down.

One throwaway compose project (its own name, volumes and loopback ports) runs the default
stack, every service of docker-compose.yml outside a profile: iop-init, the control-plane,
the edge, node-a with the iop-llamacpp container (llama.cpp and SmolLM2 inside, no
registry), the worker. A chat completion goes through the edge's OpenAI API with the
official SDK, with an API key issued by the control-plane's CLI in its container (the edge
serves no one but loopback clients without keys, and the host is not the container's
loopback); the edge's run history then names the provider that served it. A second project,
deploy/node-host/, plays a remote node host: node-b with the files of `iop-init --bundle`,
on a network of its own shared only with the edge. The images are those of `make images`
(conftest.py checks they are there); `make test-containers` builds them.

The vLLM test also needs a GPU (the gpu profile); without one it skips, saying so.
"""

from __future__ import annotations

import contextlib
import io
import re
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compose_helpers import (
    chat,
    compose,
    compose_project,
    docker,
    issue_key,
    wait_for_providers,
    wait_until_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
NODE_HOST = ROOT / "deploy" / "node-host"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# The services `docker compose up` starts with no profile.
DEFAULT_SERVICES = {"iop-init", "control-plane", "edge", "node-a", "worker", "llamacpp"}
SERVICE_UID = 10001


@pytest.fixture(scope="module")
def stack(
    docker_compose: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, str, str]]:
    """The default stack, healthy: (the compose project, the edge's API URL, an API key)."""
    env = {"EDGE_PUBLISH_ADDRESS": "127.0.0.1", "LLAMACPP_THREADS": "1"}
    work = tmp_path_factory.mktemp("stack")
    with compose_project(["docker-compose.yml"], ROOT, env, work) as project:
        wait_until_healthy(project, DEFAULT_SERVICES)
        api_port = project.get_service_port("edge", 8080)
        yield project, f"http://127.0.0.1:{api_port}", issue_key(project)


def test_the_default_stack_comes_up_healthy_with_no_profiled_provider(
    stack: tuple[Any, str, str],
) -> None:
    project, _api, _key = stack
    running = {c.Service for c in project.get_containers(include_all=True)}
    assert (
        running == DEFAULT_SERVICES
    )  # no ollama, vllm or upstream llama.cpp: their profiles are off


def test_chat_completion_goes_client_edge_node_llamacpp_container(
    stack: tuple[Any, str, str],
) -> None:
    _project, api, key = stack
    wait_for_providers(api, key, "smollm2:135m", {"node-a-llamacpp"})
    run = chat(api, key, "smollm2:135m")
    assert (run["model"], run["provider_id"], run["outcome"]) == (
        "smollm2:135m",
        "node-a-llamacpp",
        "completed",
    )


def test_every_long_running_service_runs_as_uid_10001(stack: tuple[Any, str, str]) -> None:
    """The real processes, seen from the host (/proc), not the image's configuration."""
    project, _api, _key = stack
    for container in project.get_containers():
        pid = docker("inspect", "--format", "{{.State.Pid}}", str(container.ID)).strip()
        status = Path(f"/proc/{pid}/status").read_text()
        uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, re.MULTILINE)
        assert uids is not None
        assert (container.Service, uids.groups()) == (container.Service, (str(SERVICE_UID),) * 2)


def test_a_remote_node_host_joins_with_a_bundle_from_iop_init(
    stack: tuple[Any, str, str], tmp_path: Path
) -> None:
    """deploy/node-host/ as another host: node-b's certificate, key and token from
    `iop-init --bundle node-b`, the edge reached by name on a network that only the edge and
    this host's node share, no provider profile (so only the node starts: its mock provider).
    With node-a stopped, node-b's mock is the only provider of mock-small left."""
    project, api, key = stack
    bundle = compose(project, "run", "--rm", "-T", "iop-init", "--bundle", "node-b")
    with tarfile.open(fileobj=io.BytesIO(bundle)) as archive:
        archive.extractall(tmp_path / "host", filter="tar")  # as root: owned by uid 10001, as made
    wan = f"iop-test-wan-{uuid.uuid4().hex[:8]}"
    edge = project.get_container("edge").ID
    docker("network", "create", wan)
    try:
        docker("network", "connect", "--alias", "edge", wan, str(edge))
        override = tmp_path / "wan.yml"
        override.write_text(
            "services:\n  node:\n    networks: [default, wan]\n"
            f"networks:\n  wan:\n    external: true\n    name: {wan}\n"
        )
        env = {
            "NODE_ID": "node-b",
            "EDGE_HOST": "edge",
            "NODE_CERTS_DIR": str(tmp_path / "host" / "certs"),
            "NODE_TOKEN_FILE": str(tmp_path / "host" / "node.token"),
        }
        files = ["docker-compose.node.yml", str(override)]
        with compose_project(files, NODE_HOST, env, tmp_path) as host:
            wait_for_providers(api, key, "mock-small", {"node-a-mock", "node-b-mock"})
            assert {c.Service for c in host.get_containers(include_all=True)} == {"node"}
            compose(project, "stop", "node-a")
            try:
                wait_for_providers(api, key, "mock-small", {"node-b-mock"})
                run = chat(api, key, "mock-small")
                assert (run["provider_id"], run["outcome"]) == ("node-b-mock", "completed")
            finally:
                compose(project, "start", "node-a")
    finally:
        with contextlib.suppress(AssertionError):
            docker("network", "disconnect", "--force", wan, str(edge))
        docker("network", "rm", wan)


def test_down_leaves_nothing_behind(stack: tuple[Any, str, str]) -> None:
    """`down` removes the project's containers and networks and keeps its volumes
    (certificates, tokens, databases); `down --volumes` removes those too. Last in the file."""
    project, _api, _key = stack
    name = str(project.get_container("edge").Project)
    label = f"label=com.docker.compose.project={name}"
    assert docker("volume", "ls", "--quiet", "--filter", label).split()
    compose(project, "down")
    assert docker("ps", "--all", "--quiet", "--filter", label) == ""
    assert docker("network", "ls", "--quiet", "--filter", label) == ""
    assert docker("volume", "ls", "--quiet", "--filter", label).split()  # kept by design
    compose(project, "down", "--volumes")
    assert docker("volume", "ls", "--quiet", "--filter", label) == ""


def test_chat_completion_through_the_edge_to_vllm(
    gpu: None, docker_compose: str, tmp_path: Path
) -> None:
    env = {"EDGE_PUBLISH_ADDRESS": "127.0.0.1"}
    files = ["docker-compose.yml"]
    with compose_project(files, ROOT, env, tmp_path, profiles=["gpu"]) as project:
        api = f"http://127.0.0.1:{project.get_service_port('edge', 8080)}"
        key = issue_key(project)
        wait_for_providers(api, key, "qwen2.5:0.5b", {"node-gpu-vllm"})
        run = chat(api, key, "qwen2.5:0.5b")
        assert (run["provider_id"], run["outcome"]) == ("node-gpu-vllm", "completed")
