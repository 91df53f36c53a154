"""Each image, built as `make images` builds it, runs its console script as uid 10001.

The images need BuildKit (`RUN --mount`), which the Docker SDK's build API does not drive,
so they are built with the docker CLI; testcontainers then runs them. Where no Docker
engine answers (here and in CI) every test skips, saying so.
"""

from __future__ import annotations

import json
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
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def version_of(package: str) -> str:
    with (ROOT / package / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_builds_and_runs_its_console_script(docker: str, image: str) -> None:
    from testcontainers.core.container import DockerContainer  # after the engine check

    directory, package, script = IMAGES[image]
    version = version_of(package)
    tag = f"{image}:test-{uuid.uuid4().hex[:8]}"
    build = [docker, "build", "--file", f"{directory}/Dockerfile"]
    build += ["--build-arg", f"VERSION={version}", "--tag", tag, "."]
    result = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=1700)
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
        else:
            assert config["User"] == "10001:10001"
            assert config["Entrypoint"] == [script]
            assert "/healthz" in " ".join(config["Healthcheck"]["Test"])
        with DockerContainer(tag, command="--help") as container:
            wrapped = container.get_wrapped_container()
            status = wrapped.wait(timeout=120)
            logs = wrapped.logs().decode()
        assert status["StatusCode"] == 0, logs
        assert f"usage: {script}" in logs
    finally:
        subprocess.run([docker, "image", "rm", "--force", tag], capture_output=True, timeout=120)
