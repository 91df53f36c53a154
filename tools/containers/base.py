"""A Python base image made from Debian's packages, for machines that reach no image registry.

`debootstrap --variant=minbase` builds a bookworm root file system with python3, python3-venv
(the images install into a venv: Debian's pip refuses the system Python, PEP 668) and libgomp1
(llama.cpp's OpenMP runtime); `docker import` makes it an image. The root file system is kept
as a tarball under var/ so that a second run only imports it (seconds, not a minute).
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


def make_rootfs_tarball(tarball: Path, mirror: str) -> None:
    """debootstrap into a temporary directory, trimmed, then packed into `tarball`."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SystemExit("containers: debootstrap is not installed (apt-get install debootstrap)")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix=".rootfs-") as work:
        root = Path(work) / "rootfs"
        say(f"debootstrap {SUITE} + {' '.join(PACKAGES)} from {mirror} (about a minute)")
        include = ",".join(PACKAGES)
        command = [debootstrap, "--variant=minbase", f"--include={include}", SUITE, str(root)]
        subprocess.run([*command, mirror], check=True, stdout=subprocess.DEVNULL)
        # What a container never needs: package caches and lists, documentation.
        for junk in (
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
        ):
            shutil.rmtree(root / junk, ignore_errors=True)
        partial = tarball.with_suffix(".partial")
        subprocess.run(
            ["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True
        )
        partial.rename(tarball)


def ensure_base_image(docker: list[str], tag: str, cache: Path, mirror: str = MIRROR) -> str:
    """`tag` in the engine, imported from the cached root file system (made when missing)."""
    if image_exists(docker, tag):
        say(f"base image {tag} is there")
        return tag
    tarball = cache / f"debian-{SUITE}-python.tar"
    if not tarball.is_file():
        make_rootfs_tarball(tarball, mirror)
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
    parser.add_argument("--tag", default=DEFAULT_TAG)
    parser.add_argument("--cache", type=Path, default=Path("var/containers/base"))
    parser.add_argument("--mirror", default=MIRROR)
    parser.add_argument("--docker", default="docker", help="the docker CLI")
    args = parser.parse_args(argv)
    print(ensure_base_image([args.docker], args.tag, args.cache, args.mirror))
    return 0


if __name__ == "__main__":
    sys.exit(main())
