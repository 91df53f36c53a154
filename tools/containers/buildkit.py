"""Which docker CLI builds the images with BuildKit, or why none can.

The Dockerfiles use `RUN --mount`, which only BuildKit runs. A docker CLI of release 23 or
later builds with BuildKit only through its buildx plugin; without the plugin it falls back to
the legacy builder (which rejects `RUN --mount`), and `DOCKER_BUILDKIT=1` makes it fail
("buildx component is missing"). Debian's docker.io (20.10) has BuildKit built in and uses it
when `DOCKER_BUILDKIT=1` is set. So: the first docker on PATH with buildx, else the first of
release < 23, else a message naming what is missing.

    python tools/containers/buildkit.py --check     exit 1 saying why when no CLI can build
    python tools/containers/buildkit.py --command   the build command (`docker build` if none)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def _run(*command: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def candidates() -> list[str]:
    """Every `docker` on PATH, in PATH order, each once."""
    found: list[str] = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        path = Path(directory or ".") / "docker"
        if os.access(path, os.X_OK) and str(path.resolve()) not in {
            str(Path(f).resolve()) for f in found
        }:
            found.append(str(path))
    return found


def client_major(cli: str) -> int | None:
    result = _run(cli, "version", "--format", "{{.Client.Version}}")
    if result is None or not result.stdout.strip():
        return None
    try:
        return int(result.stdout.strip().split(".")[0])
    except ValueError:
        return None


def has_buildx(cli: str) -> bool:
    result = _run(cli, "buildx", "version")
    return result is not None and result.returncode == 0


def buildkit_cli() -> tuple[str | None, str]:
    """(the CLI, "") when one builds with BuildKit, else (None, what is missing)."""
    clis = candidates()
    if not clis:
        return None, "the docker CLI is not installed (Debian: apt-get install docker.io)"
    seen = []
    for cli in clis:
        major = client_major(cli)
        if has_buildx(cli) or (major is not None and major < 23):
            return cli, ""
        seen.append(f"{cli} ({major if major is not None else '?'}.x, no buildx plugin)")
    return None, (
        "no docker CLI here builds with BuildKit, which the Dockerfiles need (RUN --mount): "
        f"{', '.join(seen)}; install the buildx plugin (docker-buildx-plugin, or Debian's "
        "docker-buildx) or use Debian's docker.io (/usr/bin/docker 20.10)"
    )


def engine_answers(cli: str) -> bool:
    result = _run(cli, "info")
    return result is not None and result.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The docker CLI that builds with BuildKit.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 saying what is missing")
    mode.add_argument("--command", action="store_true", help="print the build command")
    args = parser.parse_args(argv)
    cli, missing = buildkit_cli()
    if args.command:
        print(f"DOCKER_BUILDKIT=1 {cli} build" if cli else "docker build")
        return 0
    if cli is None:
        print(f"make images: {missing}", file=sys.stderr)
        return 1
    if not engine_answers(cli):
        print(
            f"make images: no Docker engine answers '{cli} info' (start one, or point "
            "DOCKER_HOST at one; `make test-containers` starts its own)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
