"""Base images made from Debian's packages, for machines that reach no image registry.

`debootstrap --variant=minbase` builds a bookworm root file system with python3, python3-venv
(the images install into a venv: Debian's pip refuses the system Python, PEP 668) and libgomp1
(llama.cpp's OpenMP runtime); `docker import` makes it an image. The servers base is that root
file system with Debian's PostgreSQL 15 and HAProxy added by apt in a chroot (the iop-postgres
and iop-haproxy images of docker-compose.yml's `ha` profile, whose builds get no network): a
second image, so the service images do not carry two servers they never run. Each root file
system is kept as a tarball under var/ so that a second run only imports it (seconds, not a
minute or two).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "libgomp1", "ca-certificates")
DEFAULT_TAG = "iop-base:bookworm-python3.11"
SERVER_PACKAGES = ("postgresql-15", "haproxy", "prometheus")
# Bumped with SERVER_PACKAGES (2: prometheus), so that a base cached without a package is not
# reused: its tag and its tarball carry the revision.
SERVERS_REVISION = 2
SERVER_TAG = f"iop-base:bookworm-servers-{SERVERS_REVISION}"
# The image config that `docker import` cannot take from a Dockerfile.
CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    'CMD ["python3"]',
)


def say(text: str) -> None:
    print(f"containers: {text}", file=sys.stderr, flush=True)


def image_exists(docker: list[str], tag: str) -> bool:
    found = subprocess.run([*docker, "image", "inspect", tag], capture_output=True, check=False)
    return found.returncode == 0


def trim(root: Path) -> None:
    """What a container never needs: package caches and lists, documentation."""
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
        shutil.rmtree(root / junk, ignore_errors=True)


def pack(root: Path, tarball: Path) -> None:
    partial = tarball.with_suffix(".partial")
    command = ["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."]
    subprocess.run(command, check=True)
    partial.rename(tarball)


def add_server_packages(root: Path) -> None:
    """apt-get install SERVER_PACKAGES inside `root` (a chroot, the host's network and DNS).

    policy-rc.d stops the packages' scripts from starting a server in the chroot, and
    createcluster.d stops postgresql-common from making a cluster the image never uses (the
    iop-postgres entrypoint makes its own in the volume); both are as the official PostgreSQL
    image does. ssl-cert's snakeoil key is removed: a key made here would be in every image."""
    resolv = root / "etc" / "resolv.conf"
    saved = resolv.read_bytes() if resolv.is_file() else None
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    policy = root / "usr" / "sbin" / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    cluster = root / "etc" / "postgresql-common" / "createcluster.d"
    cluster.mkdir(parents=True, exist_ok=True)
    (cluster / "iop-no-main-cluster.conf").write_text("create_main_cluster = false\n")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"}
    install = "apt-get install -y -qq --no-install-recommends " + " ".join(SERVER_PACKAGES)
    try:
        say(f"apt-get install {' '.join(SERVER_PACKAGES)} in the base's root file system")
        command = ["chroot", str(root), "sh", "-c", f"apt-get update -qq && {install}"]
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    finally:
        policy.unlink(missing_ok=True)
        resolv.unlink(missing_ok=True)
        if saved is not None:
            resolv.write_bytes(saved)
    for key in ("etc/ssl/private/ssl-cert-snakeoil.key", "etc/ssl/certs/ssl-cert-snakeoil.pem"):
        (root / key).unlink(missing_ok=True)


def make_rootfs_tarballs(python: Path, servers: Path, mirror: str) -> None:
    """debootstrap into a temporary directory, trimmed, packed into `python`; then the
    server packages added, trimmed again, packed into `servers`."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SystemExit("containers: debootstrap is not installed (apt-get install debootstrap)")
    python.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=python.parent, prefix=".rootfs-") as work:
        root = Path(work) / "rootfs"
        say(f"debootstrap {SUITE} + {' '.join(PACKAGES)} from {mirror} (about a minute)")
        include = ",".join(PACKAGES)
        command = [debootstrap, "--variant=minbase", f"--include={include}", SUITE, str(root)]
        subprocess.run([*command, mirror], check=True, stdout=subprocess.DEVNULL)
        trim(root)
        pack(root, python)
        add_server_packages(root)
        trim(root)
        pack(root, servers)


def ensure_base_image(
    docker: list[str], tag: str, cache: Path, mirror: str = MIRROR, *, servers: bool = False
) -> str:
    """`tag` in the engine, imported from the cached root file system (made when missing):
    the Python base, or with `servers` the one that also has SERVER_PACKAGES."""
    if image_exists(docker, tag):
        say(f"base image {tag} is there")
        return tag
    python = cache / f"debian-{SUITE}-python.tar"
    with_servers = cache / f"debian-{SUITE}-servers-{SERVERS_REVISION}.tar"
    tarball = with_servers if servers else python
    if not tarball.is_file():
        make_rootfs_tarballs(python, with_servers, mirror)
    say(f"docker import {tarball} as {tag}")
    changes = [word for change in CHANGES for word in ("--change", change)]
    with tarball.open("rb") as stream:
        subprocess.run(
            [*docker, "import", *changes, "-", tag],
            stdin=stream,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=None, help=f"{DEFAULT_TAG} or {SERVER_TAG}")
    parser.add_argument("--servers", action="store_true", help="the base with the servers")
    parser.add_argument("--cache", type=Path, default=Path("var/containers/base"))
    parser.add_argument("--mirror", default=MIRROR)
    parser.add_argument("--docker", default="docker", help="the docker CLI")
    args = parser.parse_args(argv)
    tag = args.tag or (SERVER_TAG if args.servers else DEFAULT_TAG)
    print(ensure_base_image([args.docker], tag, args.cache, args.mirror, servers=args.servers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
