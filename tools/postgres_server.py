"""Run a PostgreSQL server in the foreground for ``make run HA=1``: the edges' shared store.

Debian's server (``apt-get install postgresql``; ``iop_proto.testing_postgres`` finds its
binaries) on a cluster of its own under ``--data`` (``var/dev/postgres/data`` by default),
made with ``initdb`` on the first start and kept across runs, like the stack's SQLite
files. Loopback only, trusting local connections: a development store. The server refuses
to run as root, so as root the cluster and the server belong to the ``postgres`` account
the package creates. Prints ``ready: postgres postgresql://...`` (the edges' DSN) once the
database ``--database`` exists, and stops the server fast (SIGINT) on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from iop_proto.testing_postgres import postgres_bindir, why_postgres_cannot_run

USER = "iop"
READY_WITHIN_S = 60.0
EXIT_OK, EXIT_FAILED, EXIT_MISSING = 0, 1, 2


def init_cluster(bindir: Path, data: Path, owner: str | None) -> None:
    """``initdb`` once: an existing cluster (PG_VERSION present) is kept with its data."""
    if (data / "PG_VERSION").is_file():
        return
    data.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        account = pwd.getpwnam(owner)
        os.chown(data, account.pw_uid, account.pw_gid)
    os.chmod(data, 0o700)
    print(f"initdb {data} (first start)", flush=True)
    command = [str(bindir / "initdb"), "-D", str(data), "--auth=trust", f"--username={USER}"]
    subprocess.run([*command, "--encoding=UTF8"], user=owner, check=True)


def accepts(bindir: Path, host: str, port: int) -> bool:
    isready = [
        str(bindir / "pg_isready"),
        "-q",
        "-h",
        host,
        "-p",
        str(port),
        "-U",
        USER,
        "-d",
        "postgres",
    ]
    return subprocess.run(isready, check=False).returncode == 0


def create_database(bindir: Path, host: str, port: int, name: str) -> None:
    """``name`` if it does not exist yet (psql has no CREATE DATABASE IF NOT EXISTS)."""
    psql = shutil.which("psql") or str(bindir / "psql")
    base = [psql, "-X", "-q", "-h", host, "-p", str(port), "-U", USER, "-d", "postgres"]
    found = subprocess.run(
        [*base, "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"],
        capture_output=True,
        text=True,
        check=True,
    )
    if found.stdout.strip() != "1":
        subprocess.run([*base, "-c", f'CREATE DATABASE "{name}"'], check=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="postgres_server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5432)
    parser.add_argument("--data", type=Path, default=Path("var/dev/postgres/data"))
    parser.add_argument("--database", default="iop")
    args = parser.parse_args(argv)
    reason = why_postgres_cannot_run()
    bindir = postgres_bindir()
    if reason is not None or bindir is None:
        print(f"postgres: {reason}", file=sys.stderr, flush=True)
        return EXIT_MISSING
    owner = "postgres" if os.geteuid() == 0 else None
    data = args.data.absolute()
    init_cluster(bindir, data, owner)
    options = [
        *("-c", f"listen_addresses={args.host}", "-c", f"port={args.port}"),
        *("-c", f"unix_socket_directories={data}", "-c", "max_connections=100"),
    ]
    # The server itself as the child (``user=``, not a runuser wrapper): signals reach it.
    server = subprocess.Popen([str(bindir / "postgres"), "-D", str(data), *options], user=owner)
    stop = [False]

    def on_signal(signum: int, frame: object) -> None:
        stop[0] = True
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deadline = time.monotonic() + READY_WITHIN_S
    while not accepts(bindir, args.host, args.port):
        if server.poll() is not None or time.monotonic() > deadline:
            print("postgres: the server did not accept connections", file=sys.stderr, flush=True)
            on_signal(signal.SIGTERM, None)
            server.wait()
            return EXIT_FAILED
        time.sleep(0.2)
    create_database(bindir, args.host, args.port, args.database)
    print(
        f"ready: postgres postgresql://{USER}@{args.host}:{args.port}/{args.database}", flush=True
    )
    code = server.wait()
    return EXIT_OK if stop[0] else (code or EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
