"""Test hosts made from Linux network namespaces, joined by a bridge in one more.

Each host is a namespace with one interface (``eth0``, 10.77.0.<n>/24) whose veth peer is a
port of a bridge living in its own namespace, so the hosts reach each other and nothing
else: no address of theirs exists in the machine's own namespace, and no route leads out.
Names carry this process's id, so two runs on one machine never collide, and everything
made is removed on the way out, whatever happened (removing a namespace removes its
interfaces; a veth end still in the machine's namespace is removed by name).

``cut`` takes a host's bridge port down: from then on nothing crosses, and neither side is
told (no FIN, no RST, no ICMP): the silent partition a pulled cable or a dead switch makes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.77.0"
PREFIX_LEN = 24
_runs = itertools.count()


class NamespacesUnavailable(Exception):
    """Namespaces cannot be made here (not root, no iproute2, or the kernel refuses)."""


@dataclass(frozen=True)
class Host:
    """One test host: a namespace and its address on the shared segment."""

    number: int
    namespace: str
    address: str
    bridge_port: str  # its veth peer, a port of the bridge (in the bridge's namespace)

    @property
    def wrapper(self) -> tuple[str, ...]:
        """Prefix of a command run on this host (execs the command: signals reach it)."""
        return ("ip", "netns", "exec", self.namespace)


@dataclass(frozen=True)
class Network:
    """The hosts and the bridge joining them."""

    bridge_namespace: str
    hosts: tuple[Host, ...]

    def host(self, number: int) -> Host:
        return self.hosts[number - 1]

    def cut(self, number: int) -> None:
        """Take host ``number``'s link down silently (its bridge port, not its own end)."""
        port = self.host(number).bridge_port
        _ip("-n", self.bridge_namespace, "link", "set", port, "down")

    def mend(self, number: int) -> None:
        """Bring host ``number``'s link back up."""
        _ip("-n", self.bridge_namespace, "link", "set", self.host(number).bridge_port, "up")

    def add_address(self, number: int, address: str) -> None:
        """Give host ``number`` one more address on the segment (a second name for it)."""
        _ip(
            "-n",
            self.host(number).namespace,
            "addr",
            "add",
            f"{address}/{PREFIX_LEN}",
            "dev",
            "eth0",
        )


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(
            result.returncode, ["ip", *args], result.stdout, result.stderr
        )


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can (checked by making one)."""
    if shutil.which("ip") is None:
        return "iproute2's 'ip' is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in CI's .ci/run)"
    probe = f"iopmhprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"'ip netns add' is refused here: {exc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False, timeout=10)
    return None


def _kill_leftovers(namespace: str) -> None:
    """SIGKILL what still runs in one of our namespaces (only ever our own processes:
    the namespace was made by this run and only its commands entered it)."""
    listed = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False, timeout=10
    )
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def make_hosts(count: int) -> Iterator[Network]:
    """Make ``count`` hosts on one bridge; remove them all on exit."""
    reason = unavailable_reason()
    if reason is not None:
        raise NamespacesUnavailable(reason)
    tag = f"iopmh{os.getpid() % 100000}{next(_runs)}"  # <= 11 characters: 15 with a suffix
    bridge_ns = f"{tag}br"
    hosts = tuple(Host(n, f"{tag}h{n}", f"{SUBNET}.{n}", f"{tag}p{n}") for n in range(1, count + 1))
    made: list[str] = []
    try:
        _ip("netns", "add", bridge_ns)
        made.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            inner = f"{tag}e{host.number}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", host.bridge_port)
            _ip("link", "set", host.bridge_port, "netns", bridge_ns)
            _ip("link", "set", inner, "netns", host.namespace)
            _ip("-n", host.namespace, "link", "set", inner, "name", "eth0")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", bridge_ns, "link", "set", host.bridge_port, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", host.bridge_port, "up")
        yield Network(bridge_ns, hosts)
    finally:
        for namespace in reversed(made):
            _kill_leftovers(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        for host in hosts:  # a veth end left behind by a failure before its move
            for name in (f"{tag}e{host.number}", host.bridge_port):
                subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
