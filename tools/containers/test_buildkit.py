"""buildkit.py picks a docker CLI that builds with BuildKit, or names what is missing.

The CLIs are small shell scripts on a PATH of the test's own, answering `version` and
`buildx version` as the real ones do: 28.x without buildx (the machine's /usr/local/bin/docker),
28.x with buildx, and Debian's 20.10 (BuildKit built in, DOCKER_BUILDKIT=1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "buildkit.py"


def fake_docker(directory: Path, version: str, buildx: bool) -> Path:
    directory.mkdir(parents=True)
    cli = directory / "docker"
    buildx_exit = 0 if buildx else 1
    cli.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = version ]; then echo {version}; exit 0; fi\n'
        f'if [ "$1" = buildx ]; then exit {buildx_exit}; fi\n'
        'if [ "$1" = info ]; then exit 0; fi\n'
        "exit 2\n"
    )
    cli.chmod(0o755)
    return cli


def run(path: list[Path], *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": os.pathsep.join(map(str, path))}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_current_cli_without_buildx_is_passed_over_for_debians(tmp_path: Path) -> None:
    current = fake_docker(tmp_path / "local", "28.2.2", buildx=False)
    debian = fake_docker(tmp_path / "debian", "20.10.24+dfsg1", buildx=False)
    result = run([current.parent, debian.parent], "--command")
    assert result.stdout.strip() == f"DOCKER_BUILDKIT=1 {debian} build"
    assert run([current.parent, debian.parent], "--check").returncode == 0


def test_a_current_cli_with_buildx_is_taken_first(tmp_path: Path) -> None:
    current = fake_docker(tmp_path / "local", "28.2.2", buildx=True)
    debian = fake_docker(tmp_path / "debian", "20.10.24+dfsg1", buildx=False)
    assert (
        run([current.parent, debian.parent], "--command")
        .stdout.strip()
        .endswith(f"{current} build")
    )


@pytest.mark.parametrize("clis", [[], ["28.2.2"]], ids=["no-cli", "no-buildx"])
def test_without_a_buildkit_cli_check_fails_naming_what_is_missing(
    tmp_path: Path, clis: list[str]
) -> None:
    path = [fake_docker(tmp_path / f"cli{i}", v, buildx=False).parent for i, v in enumerate(clis)]
    result = run([*path, tmp_path / "empty"], "--check")
    assert result.returncode == 1
    assert result.stderr.startswith("make images: ")
    assert ("buildx" in result.stderr) == bool(clis)
    assert run([*path, tmp_path / "empty"], "--command").stdout.strip() == "docker build"
