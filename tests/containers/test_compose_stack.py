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
import json
import re
import subprocess
import tarfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from iop_proto.testing import port_taken, ports_to_try

ROOT = Path(__file__).resolve().parents[2]
NODE_HOST = ROOT / "deploy" / "node-host"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

READY_WITHIN_S = 300.0
# The services `docker compose up` starts with no profile, and the one-shot among them.
DEFAULT_SERVICES = {"iop-init", "control-plane", "edge", "node-a", "worker", "llamacpp"}
ONE_SHOTS = {"iop-init"}
SERVICE_UID = 10001
CONTROL_PLANE_CLI = ["iop-control-plane", "--config", "/etc/iop/control-plane.yaml"]


def get_json(url: str, key: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def compose(stack: Any, *arguments: str, stdin: bytes | None = None) -> bytes:
    """`docker compose <arguments>` of `stack`'s project; its stdout."""
    command = [*stack.compose_command_property, *arguments]
    done = subprocess.run(command, cwd=stack.context, input=stdin, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    return done.stdout


def docker(*arguments: str) -> str:
    done = subprocess.run(["docker", *arguments], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def issue_key(stack: Any) -> str:
    """An API key from the control-plane's container."""
    out, err, code = stack.exec_in_container(
        [*CONTROL_PLANE_CLI, "key", "issue", "--name", "compose-test"], "control-plane"
    )
    key = re.search(r"sk-iop-\S+", out) if code == 0 else None
    assert key is not None, f"no API key from the control-plane: {err}"
    return key.group(0)


def wait_until_healthy(stack: Any, expected: set[str]) -> dict[str, Any]:
    """Every long-running service healthy and every one-shot exited 0; {service: container}."""
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        containers = {c.Service: c for c in stack.get_containers(include_all=True)}
        done = set(containers) == expected and all(
            (c.State == "exited" and c.ExitCode == 0)
            if name in ONE_SHOTS
            else (c.State == "running" and c.Health == "healthy")
            for name, c in containers.items()
        )
        if done:
            return containers
        states = {name: (c.State, c.Health, c.ExitCode) for name, c in containers.items()}
        assert time.monotonic() < deadline, f"not healthy within {READY_WITHIN_S:.0f} s: {states}"
        time.sleep(2)


def wait_for_providers(api: str, key: str, model: str, providers: set[str]) -> None:
    """Poll the edge's catalog, its explicit readiness signal, until exactly `providers`
    serve `model` (the key, too, reaches the edge with the fleet config: 401 until then)."""
    deadline = time.monotonic() + READY_WITHIN_S
    available: set[str] = set()
    while True:
        with contextlib.suppress(OSError, ValueError):
            catalog = get_json(f"{api}/iop/v1/catalog/models", key)["data"]
            entries = {entry["id"]: entry for entry in catalog}
            available = set(entries.get(model, {}).get("available_providers", []))
            if available == providers:
                return
        assert time.monotonic() < deadline, f"{model}: {available}, not {providers}"
        time.sleep(2)


def chat(api: str, key: str, model: str) -> dict[str, Any]:
    """One chat completion through the edge; the edge's record of the run."""
    client = OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=300)
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello in one word."}],
        max_tokens=16,
        temperature=0,
    )
    client.close()
    # A small model's text varies: check the shape, never the content.
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.completion_tokens > 0
    run: dict[str, Any] = get_json(f"{api}/iop/v1/runs?limit=1", key)["data"][0]
    return run


@contextlib.contextmanager
def compose_project(
    compose_files: list[str],
    context: Path,
    env: dict[str, str],
    work: Path,
    profiles: list[str] | None = None,
) -> Iterator[Any]:
    """A started compose project; `down --volumes` at the end. Its name and `env` go to an
    env file of its own (--env-file), so every later command of it names the same project,
    whatever the process environment says; the edge's ports are chosen up front, and again
    when another process took one first."""
    from testcontainers.compose import DockerCompose  # after the engine check

    name = f"iop-test-{uuid.uuid4().hex[:8]}"
    env_file = work / f"{name}.env"
    stack: Any = None
    try:
        for ports in zip(ports_to_try(), ports_to_try(), ports_to_try(), strict=True):
            variables = {"COMPOSE_PROJECT_NAME": name, **env, "NODE_ADMIN_PORT": str(ports[2])}
            variables.update(
                zip(
                    ("EDGE_API_PORT", "EDGE_NODE_PORT", "EDGE_ADMIN_PORT"),
                    map(str, ports),
                    strict=True,
                )
            )
            env_file.write_text("".join(f"{key}={value}\n" for key, value in variables.items()))
            stack = DockerCompose(
                context,
                compose_file_name=compose_files,
                env_file=str(env_file),
                wait=False,
                profiles=profiles,
            )
            try:
                stack.start()
            except subprocess.CalledProcessError:
                stack.stop(down=True)
                if any(port_taken(port) for port in ports):
                    continue  # another process was first on one of them
                raise
            break
        yield stack
    except BaseException:
        with contextlib.suppress(Exception):  # the logs help; their absence must not hide why
            stdout, stderr = stack.get_logs()
            print(stdout[-20000:], stderr[-20000:])  # pytest shows it with the failure
        raise
    finally:
        if stack is not None:
            stack.stop(down=True)


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
