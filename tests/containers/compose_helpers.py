"""The compose helpers of tests/containers: a throwaway compose project, its health, the
edge's readiness, a chat through it (test_compose_stack.py, test_compose_ha.py)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openai import OpenAI

from iop_proto.testing import port_taken, ports_to_try

READY_WITHIN_S = 300.0
ONE_SHOTS = {"iop-init"}
CONTROL_PLANE_CLI = ["iop-control-plane", "--config", "/etc/iop/control-plane.yaml"]
# The ports a project publishes, chosen up front (docker-compose.yml's variables; the node
# host's NODE_ADMIN_PORT takes the third, which its project does not publish otherwise).
PUBLISHED = ("EDGE_API_PORT", "EDGE_NODE_PORT", "EDGE_ADMIN_PORT", "HA_API_PORT")


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
    # The run log is written behind the answer (a queue flushed every fraction of a second).
    deadline = time.monotonic() + 30
    while not (runs := get_json(f"{api}/iop/v1/runs?limit=1", key)["data"]):
        assert time.monotonic() < deadline, "the run is not in the edge's run log"
        time.sleep(0.25)
    run: dict[str, Any] = runs[0]
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
    whatever the process environment says; the published ports are chosen up front, and again
    when another process took one first."""
    from testcontainers.compose import DockerCompose  # after the engine check

    name = f"iop-test-{uuid.uuid4().hex[:8]}"
    env_file = work / f"{name}.env"
    stack: Any = None
    try:
        for ports in zip(*(ports_to_try() for _ in PUBLISHED), strict=True):
            variables = {"COMPOSE_PROJECT_NAME": name, **env, "NODE_ADMIN_PORT": str(ports[2])}
            variables.update(zip(PUBLISHED, map(str, ports), strict=True))
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
