"""Stand-ins for the units Debian's own packages bring: ``postgresql`` and ``haproxy``.

The guide installs them with ``apt-get install postgresql haproxy`` (a block the test
does not run: the packages are on the machine already, as ``.ci/run`` makes sure) and
starts them with ``systemctl restart``. A test host has no systemd and shares the
machine's file system, so each gets what the package and its unit do, in the host's own
directories and network namespace:

- ``postgresql``: installing the package creates the cluster ``<version>/main`` and starts
  it; here ``pg_createcluster`` makes it with its configuration under the host's
  ``/etc/postgresql`` (``PG_CLUSTER_CONF_ROOT``, postgresql-common's own switch for that)
  and its data, socket and log under the host's directory, and ``pg_ctlcluster`` starts,
  restarts and stops it, as Debian's ``postgresql@15-main`` unit does. The server runs as
  the ``postgres`` account the package created (it refuses root).
- ``haproxy``: Debian's unit runs ``haproxy -Ws -f /etc/haproxy/haproxy.cfg`` as root in
  the foreground; so does this, with the host's file, until its "Loading success." line.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
from dataclasses import dataclass, field
from pathlib import Path

from netns import Host

from iop_proto.testing_postgres import postgres_bindir

CLUSTER = "main"


class UnitError(AssertionError):
    """A stand-in could not do what the unit would have done."""


async def _run(host: Host, env: dict[str, str], *argv: str) -> str:
    process = await asyncio.create_subprocess_exec(
        *host.wrapper,
        *argv,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    if process.returncode != 0:
        command = " ".join(argv)
        raise UnitError(
            f"host {host.number}: {command} exited {process.returncode}:\n{out.decode()}"
        )
    return out.decode()


@dataclass
class DebianPostgres:
    """One host's cluster ``<version>/main``, where the host's directory keeps it."""

    host: Host
    root: Path  # the host's directory: its /etc, /var/lib, /run
    installed: bool = False

    @property
    def version(self) -> str:
        bindir = postgres_bindir()
        assert bindir is not None, "PostgreSQL's server is not installed (.ci/run installs it)"
        return bindir.parent.name  # /usr/lib/postgresql/15/bin

    @property
    def env(self) -> dict[str, str]:
        """What the host's commands need to find this cluster where Debian's would be: its
        configuration (postgresql-common) and its socket (psql, createuser)."""
        return {
            "PG_CLUSTER_CONF_ROOT": str(self.root / "etc/postgresql"),
            "PGHOST": str(self.root / "run/postgresql"),
        }

    async def install(self) -> None:
        """What ``apt-get install postgresql`` does to a host: the cluster, started."""
        account = pwd.getpwnam("postgres")
        socket, log = self.root / "run/postgresql", self.root / "var/log/postgresql"
        for directory in (self.root / "etc/postgresql", socket, log):
            directory.mkdir(parents=True, exist_ok=True)
        for directory in (socket, log):
            os.chown(directory, account.pw_uid, account.pw_gid)
        data = self.root / "var/lib/postgresql" / self.version / CLUSTER
        await _run(
            self.host,
            self.env,
            "pg_createcluster",
            self.version,
            CLUSTER,
            *("-d", str(data), "-s", str(socket), "-p", "5432"),
            *("-l", str(log / f"postgresql-{self.version}-{CLUSTER}.log")),
            *("-o", f"external_pid_file={socket}/{self.version}-{CLUSTER}.pid"),
            # A test's data need not survive a power cut; the rest is Debian's default.
            *("-o", "fsync=off"),
        )
        self.installed = True
        await self.control("start")

    async def control(self, action: str) -> None:
        """``pg_ctlcluster VERSION main ACTION`` in the host's namespace (what the unit runs)."""
        if not self.installed:
            raise UnitError("systemctl on postgresql before the package was installed")
        await _run(
            self.host,
            self.env,
            "pg_ctlcluster",
            "--skip-systemctl-redirect",
            self.version,
            CLUSTER,
            action,
            *(("-m", "fast") if action in ("stop", "restart") else ()),
        )


@dataclass
class Haproxy:
    """HAProxy as Debian's unit runs it, on one host."""

    host: Host
    config: Path
    process: asyncio.subprocess.Process | None = None
    log: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.host.wrapper,
            "haproxy",
            "-Ws",
            "-f",
            str(self.config),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(30):
            while line := (await self.process.stdout.readline()).decode():
                self.log.append(line)
                if "Loading success." in line:
                    self._reader = asyncio.create_task(self._keep_reading())
                    return
        raise UnitError(f"haproxy exited before it was ready:\n{''.join(self.log)}")

    async def _keep_reading(self) -> None:
        # Read on, so the pipe never fills and stalls it (its tcplog: a line a connection).
        assert self.process is not None
        assert self.process.stdout is not None
        while line := (await self.process.stdout.readline()).decode():
            self.log.append(line)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.process.wait(), 30)
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 10)  # ends with the pipe
