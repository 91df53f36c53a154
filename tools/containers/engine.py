"""A Docker engine of the test run's own: installed with apt if missing, state under var/.

dockerd runs with its own data root, exec root and unix socket under `state`, so it shares
nothing with any other engine of the machine, and with `--iptables=false --ip6tables=false
--bridge=none`: it changes no firewall rule and creates no docker0; the compose projects get
user-defined bridge networks, and published ports go through docker-proxy (the userland
proxy) on the loopback. It starts its own containerd (a child, under the exec root), and is
stopped by its PID whatever happened, which also stops that containerd.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

APT_PACKAGES = ("docker.io", "containerd", "runc", "debootstrap")
START_WITHIN_S = 60.0
STOP_WITHIN_S = 60.0


def say(text: str) -> None:
    print(f"containers: {text}", file=sys.stderr, flush=True)


def apt_install(packages: tuple[str, ...] = APT_PACKAGES) -> None:
    """Debian's engine, containerd, runc and debootstrap. The machine's policy-rc.d (or
    none being started by dpkg in a container) means no daemon starts by itself."""
    say(f"apt-get install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    subprocess.run(install, check=True, env=env, stdout=subprocess.DEVNULL)


def ensure_installed() -> str:
    """The path of dockerd, installing Debian's packages when dockerd or debootstrap is missing."""
    if shutil.which("dockerd") is None or shutil.which("debootstrap") is None:
        if shutil.which("apt-get") is None:
            raise SystemExit("containers: no dockerd here and no apt-get to install one")
        apt_install()
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise SystemExit("containers: dockerd is still missing after apt-get install docker.io")
    return dockerd


@dataclass
class Engine:
    """A running dockerd: its process and where clients reach it."""

    process: subprocess.Popen[bytes]
    socket: Path
    log: Path

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_WITHIN_S; dockerd stops its containers and its
        containerd itself on SIGTERM."""
        if self.process.poll() is not None:
            return
        say(f"stopping dockerd (pid {self.process.pid})")
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            say(f"dockerd (pid {self.process.pid}) did not stop: SIGKILL")
            self.process.kill()
            self.process.wait()


def answers(docker_host: str) -> bool:
    docker = shutil.which("docker") or "docker"
    env = {**os.environ, "DOCKER_HOST": docker_host}
    try:
        info = subprocess.run(
            [docker, "info"], capture_output=True, timeout=30, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return info.returncode == 0


def start(dockerd: str, state: Path) -> Engine:
    """dockerd with everything under `state`; returns once `docker info` answers."""
    for name in ("data", "exec"):
        (state / name).mkdir(parents=True, exist_ok=True)
    socket, log = state / "docker.sock", state / "dockerd.log"
    socket.unlink(missing_ok=True)
    command = [
        dockerd,
        f"--data-root={state / 'data'}",
        f"--exec-root={state / 'exec'}",
        f"--pidfile={state / 'dockerd.pid'}",
        f"--host=unix://{socket}",
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
    ]
    say(f"starting dockerd, state in {state} (log: {log})")
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    engine = Engine(process, socket, log)
    deadline = time.monotonic() + START_WITHIN_S
    while not (socket.exists() and answers(engine.host)):
        if process.poll() is not None or time.monotonic() > deadline:
            engine.stop()
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"containers: dockerd did not start:\n{tail}")
        time.sleep(0.5)
    say(f"dockerd answers on {engine.host} (pid {process.pid})")
    return engine
