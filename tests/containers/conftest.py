"""What the container tests need from the machine, each checked once, each a stated skip.

`make test-containers` (tools/containers/run.py) provides all of it: a Docker engine of its
own, Compose v2, a docker CLI that builds with BuildKit, every image built; it sets
TEST_CONTAINERS_REQUIRED=1, which turns each skip below into a failure. `make test` leaves
them out (pyproject.toml's testpaths); `pytest tests/containers` on a machine where no
engine answers skips them all, saying why. The vLLM test also needs a
GPU and keeps its skip even there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "containers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compose_helpers.py

import buildkit  # noqa: E402  (tools/containers/, which `make images` uses too)

NO_ENGINE = "no Docker engine answers (`make test-containers` starts one)"
NO_COMPOSE = "the docker CLI has no compose plugin (Compose v2)"
NO_GPU = "no GPU (nvidia-smi does not answer)"
REQUIRED = os.environ.get("TEST_CONTAINERS_REQUIRED") == "1"
STACK_IMAGES = (
    "iop-init",
    "iop-control-plane",
    "iop-edge",
    "iop-node",
    "iop-worker",
    "iop-llamacpp",
)


def unavailable(reason: str) -> None:
    """A skip, or a failure where `make test-containers` promised everything."""
    if REQUIRED:
        pytest.fail(f"TEST_CONTAINERS_REQUIRED=1 but {reason}")
    pytest.skip(reason)


def _answers(*command: str) -> bool:
    try:
        result = subprocess.run(command, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


@pytest.fixture(scope="session")
def docker() -> str:
    """The docker CLI of a running Docker engine that builds with BuildKit."""
    cli, missing = buildkit.buildkit_cli()
    if cli is None:
        any_cli = shutil.which("docker")
        unavailable(NO_ENGINE if any_cli is None or not _answers(any_cli, "info") else missing)
    assert cli is not None
    if not _answers(cli, "info"):
        unavailable(NO_ENGINE)
    return cli


@pytest.fixture(scope="session")
def docker_compose(docker: str) -> str:
    """The same CLI, with Compose v2 and the stack's images (`make images`) in the engine."""
    if not _answers(docker, "compose", "version"):
        unavailable(NO_COMPOSE)
    missing = [
        image
        for image in STACK_IMAGES
        if not _answers(docker, "image", "inspect", f"{image}:latest")
    ]
    if missing:
        unavailable(f"images not built (`make images`): {', '.join(missing)}")
    return docker


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """The wheels the images install from (`make wheelhouse`)."""
    folder = ROOT / "wheelhouse"
    if not any(folder.glob("*.whl")):
        unavailable("the wheelhouse is empty (`make wheelhouse`)")
    return folder


@pytest.fixture(scope="session")
def gpu() -> None:
    """An NVIDIA GPU on this machine (the vllm service reserves one through the engine).
    Not required by TEST_CONTAINERS_REQUIRED: no machine of CI has one."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not _answers(smi):
        pytest.skip(NO_GPU)
