"""A backup directory: a consistent copy of a service's SQLite files (and contents), its
PostgreSQL store's dump, and a manifest naming the release and schema versions.

Why SQLite's online backup API and not a copy of the file: a live database in WAL mode
keeps its latest commits in ``<file>-wal`` until a checkpoint, so a copy of the main
file alone misses them (and a copy of both, taken while a writer runs, can tear). The
backup API reads one snapshot under a read transaction, while the service goes on
writing. The copy is switched out of WAL mode so the backup is one self-contained file
per database.

Restore puts each file back whole (written beside it, then renamed over it); it refuses
a backup whose schema is newer than this release reads (the service would refuse to
open it), one made for another service, and, unless ``force``, to replace files that
exist (they may be a running service's: stop it first).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from iop_proto.backup import pg_tools
from iop_proto.backup.errors import BackupError

MANIFEST = "manifest.json"
FORMAT = 1
"""The layout of a backup directory; a restore refuses a format it does not know."""
PG_DUMP = "postgres.dump"
_SIDE_FILES = ("-wal", "-shm")
_PARTIAL = "*.partial"  # an upload still being written (batch_files): not content yet


@dataclass(frozen=True, slots=True)
class StateFile:
    """One SQLite database a service keeps."""

    name: str  # its name inside the backup, e.g. "credentials.db"
    path: Path  # where the service keeps it (its settings)
    schema_version: int  # the PRAGMA user_version this release reads; newer is refused
    contents: Path | None = None  # a directory of contents whose rows the database holds


@dataclass(frozen=True, slots=True)
class ServiceState:
    """Everything one service keeps: its SQLite files, or its PostgreSQL store."""

    service: str  # "control-plane", "edge", "node"
    release: str  # the service's version, recorded in the manifest
    files: Sequence[StateFile] = ()
    postgres_dsn: str | None = None  # set: the store is PostgreSQL, dumped with pg_dump
    postgres_versions: Mapping[str, int] = field(default_factory=dict)  # component: steps


@dataclass(frozen=True, slots=True)
class Manifest:
    service: str
    release: str
    created_at: str
    files: dict[str, int]  # name: schema version of the copy
    postgres: dict[str, int] | None  # component: schema version in the dump; None: no dump

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "service": self.service,
                "release": self.release,
                "created_at": self.created_at,
                "files": self.files,
                "postgres": self.postgres,
            },
            indent=2,
        )

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise BackupError(f"{directory}: not a backup (no {MANIFEST})") from None
        except (OSError, ValueError) as exc:
            raise BackupError(f"{path}: unreadable: {exc}") from None
        if data.get("format") != FORMAT:
            raise BackupError(f"{path}: backup format {data.get('format')!r} is not {FORMAT}")
        return cls(
            service=str(data["service"]),
            release=str(data["release"]),
            created_at=str(data["created_at"]),
            files={str(k): int(v) for k, v in data["files"].items()},
            postgres=None
            if data.get("postgres") is None
            else {str(k): int(v) for k, v in data["postgres"].items()},
        )


def make_backup(state: ServiceState, destination: Path) -> Manifest:
    """Copy ``state`` into ``destination`` (a new or empty directory) while it is live."""
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise BackupError(f"{destination} exists and is not an empty directory")
    created = not destination.exists()
    destination.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return _write_backup(state, destination)
    except BaseException:
        # No half backup left to be mistaken for a whole one (its manifest comes last).
        if created:
            shutil.rmtree(destination, ignore_errors=True)
        else:
            for entry in destination.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise


def _write_backup(state: ServiceState, destination: Path) -> Manifest:
    files: dict[str, int] = {}
    postgres: dict[str, int] | None = None
    if state.postgres_dsn is not None:
        dump = destination / PG_DUMP
        pg_tools.dump(state.postgres_dsn, dump)
        postgres = pg_tools.schema_versions(dump)
    for item in state.files:
        if not item.path.exists():
            continue  # never created (the service has not run, or not with this feature)
        target = destination / item.name
        files[item.name] = _copy_live(item.path, target)
        if item.contents is not None and item.contents.is_dir():
            # After the database: a content is durable before its row commits, so every
            # row in the copy has its content in the directory copied now.
            shutil.copytree(
                item.contents,
                destination / f"{item.name}.contents",
                ignore=shutil.ignore_patterns(_PARTIAL),
            )
    manifest = Manifest(
        service=state.service,
        release=state.release,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        files=files,
        postgres=postgres,
    )
    (destination / MANIFEST).write_text(manifest.to_json() + "\n")
    return manifest


def _copy_live(source: Path, target: Path) -> int:
    """The online backup of ``source`` into ``target``; returns its schema version."""
    live = sqlite3.connect(source, timeout=30)
    try:
        copy = sqlite3.connect(target)
        try:
            live.backup(copy)
            copy.execute("PRAGMA journal_mode = DELETE")  # one file, no -wal beside it
            version = int(copy.execute("PRAGMA user_version").fetchone()[0])
        finally:
            copy.close()
    finally:
        live.close()
    target.chmod(0o600)
    return version


def restore_backup(state: ServiceState, source: Path, *, force: bool = False) -> Manifest:
    """Put the backup in ``source`` back where ``state`` says; checks everything first."""
    manifest = Manifest.read(source)
    if manifest.service != state.service:
        raise BackupError(
            f"{source} is a backup of the {manifest.service}, not of the {state.service}"
        )
    wanted = [item for item in state.files if item.name in manifest.files]
    for item in wanted:
        _check_copy(source / item.name, item, manifest.files[item.name])
    if manifest.postgres is not None:
        if state.postgres_dsn is None:
            raise BackupError(f"{source} holds a PostgreSQL dump; this {state.service} has none")
        pg_tools.check_versions(manifest.postgres, state.postgres_versions)
    live = [str(path) for item in wanted for path in _live_paths(item) if path.exists()]
    dsn = state.postgres_dsn if manifest.postgres is not None else None
    if dsn is not None and pg_tools.holds_state(dsn):
        live.append("the PostgreSQL store's contents")
    if live and not force:
        shown = ", ".join(live)
        raise BackupError(f"would replace {shown}; stop the {state.service} first and pass --force")
    for item in wanted:
        _put_back(source, item)
    if dsn is not None:
        pg_tools.restore(dsn, source / PG_DUMP)
    return manifest


def _check_copy(copy: Path, item: StateFile, recorded: int) -> None:
    if not copy.is_file():
        raise BackupError(f"{copy}: missing from the backup its manifest describes")
    db = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
    try:
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        check = str(db.execute("PRAGMA quick_check").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise BackupError(f"{copy}: not a readable SQLite database: {exc}") from None
    finally:
        db.close()
    if check != "ok":
        raise BackupError(f"{copy}: damaged ({check})")
    if version != recorded:
        raise BackupError(f"{copy}: schema version {version}, its manifest says {recorded}")
    if version > item.schema_version:
        raise BackupError(
            f"{copy}: schema version {version} is newer than this release reads "
            f"({item.schema_version}); restore it with the release that made it, or newer"
        )


def _live_paths(item: StateFile) -> list[Path]:
    paths = [item.path, *(item.path.with_name(item.path.name + s) for s in _SIDE_FILES)]
    if item.contents is not None:
        paths.append(item.contents)
    return paths


def _put_back(source: Path, item: StateFile) -> None:
    """Written beside the live path and renamed over it, so a crash leaves the old file
    or the new one, never half of one. An older schema is migrated by the service when
    it opens the file, as after any upgrade."""
    item.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    staged = item.path.with_name(item.path.name + ".restoring")
    shutil.copyfile(source / item.name, staged)
    staged.chmod(0o600)
    for suffix in _SIDE_FILES:  # the old file's log must not be replayed onto the new one
        item.path.with_name(item.path.name + suffix).unlink(missing_ok=True)
    os.replace(staged, item.path)
    if item.contents is None:
        return
    copied = source / f"{item.name}.contents"
    if item.contents.exists():
        shutil.rmtree(item.contents)
    if copied.is_dir():
        shutil.copytree(copied, item.contents)
