"""docker-compose.yml for real: build the images, start the stack, chat through the edge.

Each test starts a throwaway compose project (its own name, volumes and host ports) with the
services up to one node, so the node's provider is the only one of its model that runs:
node-b with the real ollama/ollama container (pulling smollm2:135m), node-a with the real
llama.cpp server container, node-gpu with vLLM (gpu profile, and a GPU). iop-init, the
control-plane, the edge and the provider's one-shots start as their dependencies. The chat
completion goes through the edge's OpenAI API with the official SDK, with an API key issued
by the control-plane's CLI in its container (the edge serves no one but loopback clients
without keys, and the host is not the container's loopback); the edge's run history then
names the provider that served it.

Where no Docker engine answers (here and in CI) every test skips, saying so.
"""

from __future__ import annotations

import contextlib
import json
import re
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
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

# First start: image builds, provider image pulls and model downloads.
READY_WITHIN_S = 1800.0


def get_json(url: str, key: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


CONTROL_PLANE_CLI = ["iop-control-plane", "--config", "/etc/iop/control-plane.yaml"]


def issue_key(stack: Any) -> str:
    """An API key from the control-plane's container, once it has started."""
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        out, err, code = stack.exec_in_container(
            [*CONTROL_PLANE_CLI, "key", "issue", "--name", "compose-test"], "control-plane"
        )
        key = re.search(r"sk-iop-\S+", out) if code == 0 else None
        if key is not None:
            return key.group(0)
        assert time.monotonic() < deadline, f"no API key from the control-plane: {err}"
        time.sleep(2)


@contextlib.contextmanager
def compose_project(
    monkeypatch: pytest.MonkeyPatch, node: str, profiles: list[str] | None = None
) -> Iterator[tuple[str, str]]:
    """Start `node` and what it depends on; yields the edge's API base URL and an API key;
    removes it all."""
    from testcontainers.compose import DockerCompose  # after the engine check

    # Docker publishes the edge's ports where compose says: they are chosen up front, and
    # chosen again when another process took one before docker could bind it.
    stack: Any = None
    try:
        for ports in zip(ports_to_try(), ports_to_try(), ports_to_try(), strict=True):
            api_port, node_port, admin_port = ports
            # Compose reads these from the environment of the `docker compose` it runs.
            monkeypatch.setenv("COMPOSE_PROJECT_NAME", f"iop-test-{uuid.uuid4().hex[:8]}")
            monkeypatch.setenv("EDGE_API_PORT", str(api_port))
            monkeypatch.setenv("EDGE_NODE_PORT", str(node_port))
            monkeypatch.setenv("EDGE_ADMIN_PORT", str(admin_port))
            stack = DockerCompose(
                ROOT,
                compose_file_name="docker-compose.yml",
                build=True,
                wait=False,  # the edge's catalog says when the provider is ready (below)
                services=[node],
                profiles=profiles,
            )
            try:
                stack.start()
            except Exception:
                _down(stack)
                if any(port_taken(port) for port in ports):
                    continue  # another process was first on one of them
                raise
            break
        yield f"http://127.0.0.1:{api_port}", issue_key(stack)
    except BaseException:
        with contextlib.suppress(Exception):  # the logs help; their absence must not hide why
            stdout, stderr = stack.get_logs()
            print(stdout[-20000:], stderr[-20000:])  # pytest shows it with the failure
        raise
    finally:
        if stack is not None:
            _down(stack)


def _down(stack: Any) -> None:
    stack.services = None  # `down` the whole throwaway project, with its volumes
    stack.stop(down=True)


def wait_for_provider(api: str, key: str, model: str, provider: str) -> None:
    """Poll the edge's catalog, its explicit readiness signal, until `provider` serves
    (the key, too, reaches the edge with the fleet config: 401 until then)."""
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            catalog = get_json(f"{api}/iop/v1/catalog/models", key)["data"]
            entries = {entry["id"]: entry for entry in catalog}
            if provider in entries.get(model, {}).get("available_providers", []):
                return
        assert time.monotonic() < deadline, f"{provider} did not become available for {model}"
        time.sleep(2)


def chat_through_the_edge(api: str, key: str, model: str, provider: str) -> None:
    wait_for_provider(api, key, model, provider)
    client = OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=300)
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello in one word."}],
        max_tokens=16,
        temperature=0,
    )
    # A small model's text varies: check the shape, never the content.
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.completion_tokens > 0
    client.close()
    run = get_json(f"{api}/iop/v1/runs?limit=1", key)["data"][0]
    assert (run["model"], run["provider_id"], run["outcome"]) == (model, provider, "completed")


@pytest.mark.parametrize(
    ("node", "provider"),
    [("node-b", "node-b-ollama"), ("node-a", "node-a-llamacpp")],
    ids=["ollama", "llamacpp"],
)
def test_chat_completion_through_the_edge_to_a_real_provider_container(
    docker_compose: str, monkeypatch: pytest.MonkeyPatch, node: str, provider: str
) -> None:
    with compose_project(monkeypatch, node) as (api, key):
        chat_through_the_edge(api, key, "smollm2:135m", provider)


def test_chat_completion_through_the_edge_to_vllm(
    gpu: None, docker_compose: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with compose_project(monkeypatch, "node-gpu", profiles=["gpu"]) as (api, key):
        chat_through_the_edge(api, key, "qwen2.5:0.5b", "node-gpu-vllm")
