"""The PostgreSQL store's backup through PostgreSQL's own tools: pg_dump and pg_restore.

A dump in pg_dump's custom format is consistent (one snapshot) while the services run;
pg_restore with ``--clean --if-exists --single-transaction`` replaces what the
database holds, all or nothing. The schema versions (``iop_schema_versions``) are read
from the dump itself, so a restore refuses a store newer than this release before it
changes anything. The DSN's password goes to the tools through ``PGPASSWORD``, never
their command line (which every user of the host can read).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from iop_proto.backup.errors import BackupError


class PgToolError(BackupError):
    """pg_dump or pg_restore is missing or failed."""


def _split_password(dsn: str) -> tuple[str, dict[str, str]]:
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn, {}
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    bare = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return bare, {"PGPASSWORD": parts.password}


def _run(tool: str, dsn: str, *args: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise PgToolError(f"{tool} is not on PATH (Debian: apt install postgresql-client)")
    bare, secret = _split_password(dsn)
    result = subprocess.run(
        [found, f"--dbname={bare}", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **secret},
        check=False,
    )
    if result.returncode != 0:
        raise PgToolError(f"{tool} failed: {result.stderr.strip()}")
    return result.stdout


def holds_state(dsn: str) -> bool:
    """Whether the database holds an IOP store already (a service may be using it)."""
    answer = _run(
        "psql",
        dsn,
        "--no-psqlrc",
        "--tuples-only",
        "--no-align",
        "--command",
        "SELECT to_regclass('iop_schema_versions') IS NOT NULL",
    )
    return answer.strip() == "t"


def dump(dsn: str, target: Path) -> None:
    """The whole database in custom format (every component sharing it: one snapshot)."""
    _run("pg_dump", dsn, "--format=custom", "--no-owner", f"--file={target}")
    target.chmod(0o600)


def restore(dsn: str, dump_file: Path) -> None:
    """Replace the database's objects with the dump's, in one transaction."""
    _run(
        "pg_restore",
        dsn,
        "--clean",
        "--if-exists",
        "--no-owner",
        "--single-transaction",
        str(dump_file),
    )


def schema_versions(dump_file: Path) -> dict[str, int]:
    """``iop_schema_versions`` as the dump holds it (component: version)."""
    found = shutil.which("pg_restore")
    if found is None:
        raise PgToolError("pg_restore is not on PATH (Debian: apt install postgresql-client)")
    result = subprocess.run(
        [found, "--data-only", "--table=iop_schema_versions", "--file=-", str(dump_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise PgToolError(f"pg_restore could not read {dump_file}: {result.stderr.strip()}")
    versions: dict[str, int] = {}
    rows = False
    for line in result.stdout.splitlines():
        if line.startswith("COPY ") and "iop_schema_versions" in line:
            rows = True
        elif line == "\\.":
            rows = False
        elif rows:
            component, version = line.split("\t")
            versions[component] = int(version)
    return versions


def check_versions(dumped: Mapping[str, int], known: Mapping[str, int]) -> None:
    """Refuse a dump whose schema a component of this release cannot read."""
    for component, version in dumped.items():
        if component in known and version > known[component]:
            raise PgToolError(
                f"the dump's {component} schema is at version {version}, newer than this "
                f"release's {known[component]}; restore it with the release that made it"
            )
