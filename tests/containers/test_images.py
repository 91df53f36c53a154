"""Each image, built as `make images` builds it, runs its console script as uid 10001.

The images need BuildKit (`RUN --mount`), which the Docker SDK's build API does not drive,
so they are built with the docker CLI (DOCKER_BUILDKIT=1), on IOP_BASE_IMAGE when set (the
debootstrap base of `make test-containers`) and with no network at all: the wheelhouse is
all they install from. testcontainers then runs them. Where no Docker engine answers every
test skips, saying so (conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {  # image -> (Dockerfile, the pyproject.toml its version comes from, console script)
    "iop-control-plane": ("services/control-plane", "services/control-plane", "iop-control-plane"),
    "iop-edge": ("services/edge", "services/edge", "iop-edge"),
    "iop-node": ("services/node", "services/node", "iop-node"),
    "iop-worker": ("services/worker", "services/worker", "iop-worker"),
    "iop-init": ("deploy/init", "services/control-plane", "iop-init"),
    "iop-llamacpp": ("deploy/llamacpp", "", "llama_server"),
}
XLLAMACPP_IN = ROOT / "deploy" / "llamacpp" / "requirements.in"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def version_of(package: str) -> str:
    if not package:  # iop-llamacpp: the version of the llama.cpp it serves
        line = next(
            ln for ln in XLLAMACPP_IN.read_text().splitlines() if ln.startswith("xllamacpp==")
        )
        return line.split("==")[1].split()[0]
    with (ROOT / package / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


def run_to_completion(tag: str, command: str, entrypoint: str | None = None) -> str:
    """What the container printed; it must exit 0 (`command` is split as a shell would)."""
    from testcontainers.core.container import DockerContainer  # after the engine check

    container = DockerContainer(tag, command=command)
    if entrypoint is not None:
        container = container.with_kwargs(entrypoint=entrypoint)
    with container:
        wrapped = container.get_wrapped_container()
        status = wrapped.wait(timeout=120)
        logs = str(wrapped.logs().decode())
    assert status["StatusCode"] == 0, logs
    return logs


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_builds_offline_and_runs_its_console_script_as_uid_10001(
    docker: str, wheelhouse: Path, image: str
) -> None:
    directory, package, script = IMAGES[image]
    version = version_of(package)
    tag = f"{image}:test-{uuid.uuid4().hex[:8]}"
    build = [docker, "build", "--file", f"{directory}/Dockerfile", "--network=none"]
    build += ["--build-arg", f"VERSION={version}", "--tag", tag]
    if base := os.environ.get("IOP_BASE_IMAGE"):
        build += ["--build-arg", f"BASE_IMAGE={base}"]
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    result = subprocess.run(
        [*build, "."], cwd=ROOT, capture_output=True, text=True, timeout=1700, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    try:
        inspect = subprocess.run(
            [docker, "image", "inspect", "--format", "{{json .Config}}", tag],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        config = json.loads(inspect.stdout)
        assert config["Labels"]["org.opencontainers.image.version"] == version
        if image == "iop-init":
            assert config["User"] == "root"  # it drops to 10001 itself
        elif image == "iop-llamacpp":
            assert config["User"] == "10001:10001"
            assert config["Entrypoint"] == ["python", "/opt/iop-llamacpp/llama_server.py"]
            assert "/health" in " ".join(config["Healthcheck"]["Test"])
        else:
            assert config["User"] == "10001:10001"
            assert config["Entrypoint"] == [script]
            assert "/healthz" in " ".join(config["Healthcheck"]["Test"])
        assert f"usage: {script}" in run_to_completion(tag, "--help")
        if image != "iop-init":
            ids = "-c 'import os; print(os.getuid(), os.getgid())'"
            assert run_to_completion(tag, ids, entrypoint="python").split() == ["10001", "10001"]
    finally:
        subprocess.run([docker, "image", "rm", "--force", tag], capture_output=True, timeout=120)
