"""What the container tests need from the machine, each checked once, each a stated skip.

Here and in CI there is no Docker engine (the `docker` CLI only), so every test of this
directory skips with "no Docker engine on this machine"; the vLLM test also needs a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_ENGINE = "no Docker engine on this machine"
NO_COMPOSE = "the docker CLI has no compose plugin"
NO_BUILDKIT = "the docker CLI has no buildx plugin (BuildKit), which the Dockerfiles need"
NO_GPU = "no GPU (nvidia-smi does not answer)"


def _answers(*command: str) -> bool:
    try:
        result = subprocess.run(command, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


@pytest.fixture(scope="session")
def docker() -> str:
    """The docker CLI of a running Docker engine that builds with BuildKit."""
    cli = shutil.which("docker")
    if cli is None or not _answers(cli, "info"):
        pytest.skip(NO_ENGINE)
    if not _answers(cli, "buildx", "version"):
        pytest.skip(NO_BUILDKIT)
    return cli


@pytest.fixture(scope="session")
def docker_compose(docker: str) -> str:
    if not _answers(docker, "compose", "version"):
        pytest.skip(NO_COMPOSE)
    return docker


@pytest.fixture(scope="session")
def gpu() -> None:
    """An NVIDIA GPU on this machine (the vllm service reserves one through the engine)."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not _answers(smi):
        pytest.skip(NO_GPU)
