"""A real PostgreSQL server for tests: Debian's binaries, a throwaway cluster, loopback only.

Each test gets a database of its own (``create_database``) on one server per
test process; ``restart`` stops and starts the same cluster for the outage tests.
The server refuses to run as root, so as root the cluster belongs to the
``postgres`` account Debian's package creates.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SEARCH = ("/usr/lib/postgresql",)


def postgres_bindir() -> Path | None:
    """Where ``initdb`` and ``pg_ctl`` live, newest major version first; None if absent."""
    on_path = shutil.which("pg_config")
    if on_path:
        found = subprocess.run([on_path, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(found.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    for root in _SEARCH:
        versions = sorted(Path(root).glob("*/bin/initdb"), reverse=True)
        if versions:
            return versions[0].parent
    return None


def why_postgres_cannot_run() -> str | None:
    """The reason no test server can start here, or None when one can."""
    if postgres_bindir() is None:
        return "PostgreSQL's server is not installed (apt-get install postgresql; .ci/run does)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root with no postgres account to own the cluster"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class PostgresServer:
    """One throwaway cluster on 127.0.0.1:``port``, trusting local connections."""

    bindir: Path
    directory: Path
    port: int
    owner: str | None  # the account the server runs as when we are root

    @classmethod
    def start(cls) -> PostgresServer:
        reason = why_postgres_cannot_run()
        if reason is not None:
            raise RuntimeError(reason)
        bindir = postgres_bindir()
        assert bindir is not None
        owner = "postgres" if os.geteuid() == 0 else None
        # Outside pytest's root-only temporary tree: the postgres account must reach it.
        directory = Path(tempfile.mkdtemp(prefix="iop-pg-"))
        if owner is not None:
            account = pwd.getpwnam(owner)
            os.chown(directory, account.pw_uid, account.pw_gid)
        server = cls(bindir, directory, _free_port(), owner)
        server._run(
            "initdb",
            "-D",
            str(server.data),
            "--auth=trust",
            "--username=iop",
            "--encoding=UTF8",
            "--no-sync",
        )
        server.up()
        return server

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://iop@127.0.0.1:{self.port}/postgres"

    def dsn(self, database: str) -> str:
        return f"postgresql://iop@127.0.0.1:{self.port}/{database}"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bindir / tool), *args]
        if self.owner is not None:
            command = ["runuser", "-u", self.owner, "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def up(self) -> None:
        """Start the cluster (fsync off: a test's data need not survive a power cut)."""
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.directory} -c fsync=off "
            "-c max_connections=200 -c shared_buffers=32MB"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.directory / "log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    def down(self) -> None:
        """Stop it at once, cutting every connection (the outage the store must survive)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self, pause_s: float = 0.0) -> None:
        self.down()
        time.sleep(pause_s)
        self.up()

    def create_database(self) -> str:
        """A fresh empty database; its DSN."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self._psql(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def _psql(self, sql: str) -> None:
        psql = shutil.which("psql") or str(self.bindir / "psql")
        subprocess.run(
            [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", self.admin_dsn, "-c", sql],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.down()
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()
