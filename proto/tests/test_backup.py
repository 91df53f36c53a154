"""Backups of SQLite state (iop_proto.backup): consistent while a writer holds commits in
its WAL, and a restore that checks what it puts back before it changes anything."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from iop_proto.backup import (
    BackupError,
    ServiceState,
    StateFile,
    make_backup,
    restore_backup,
    run_backup_command,
)
from iop_proto.backup.pg_tools import _split_password


def _live_writer(path: Path, rows: int) -> sqlite3.Connection:
    """A service's connection: WAL mode, commits left in the WAL (no checkpoint)."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA wal_autocheckpoint = 0")
    db.execute("PRAGMA user_version = 3")
    db.execute("CREATE TABLE t (n INTEGER)")
    db.executemany("INSERT INTO t VALUES (?)", [(n,) for n in range(rows)])
    db.commit()
    return db


def _count(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT COUNT(*) FROM t").fetchone()[0])
    finally:
        db.close()


def _state(path: Path, version: int = 3, service: str = "edge") -> ServiceState:
    contents = path.with_suffix(".files")
    return ServiceState(service, "test", files=(StateFile("t.db", path, version, contents),))


def test_the_backup_holds_the_commits_a_copy_of_the_live_file_loses(tmp_path: Path) -> None:
    live = tmp_path / "live" / "t.db"
    live.parent.mkdir()
    writer = _live_writer(live, 50)
    try:
        shutil.copyfile(live, tmp_path / "copied.db")  # what `cp credentials.db` does
        manifest = make_backup(_state(live), tmp_path / "backup")
    finally:
        writer.close()
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        _count(tmp_path / "copied.db")  # the table and its rows were still in the WAL
    assert _count(tmp_path / "backup" / "t.db") == 50
    assert manifest.files == {"t.db": 3}
    assert not (tmp_path / "backup" / "t.db-wal").exists()  # one self-contained file


def test_restore_puts_the_database_and_its_contents_back(tmp_path: Path) -> None:
    live = tmp_path / "t.db"
    _live_writer(live, 5).close()
    contents = live.with_suffix(".files")
    contents.mkdir()
    (contents / "file-1").write_bytes(b"kept")
    (contents / "file-2.partial").write_bytes(b"half")  # an upload in progress: not content
    make_backup(_state(live), tmp_path / "backup")
    live.unlink()
    shutil.rmtree(contents)
    restore_backup(_state(live), tmp_path / "backup")
    assert _count(live) == 5
    assert (contents / "file-1").read_bytes() == b"kept"
    assert not (contents / "file-2.partial").exists()


def test_restore_refuses_to_replace_existing_files_unless_forced(tmp_path: Path) -> None:
    live = tmp_path / "t.db"
    _live_writer(live, 5).close()
    make_backup(_state(live), tmp_path / "backup")
    db = sqlite3.connect(live)
    db.execute("DELETE FROM t")
    db.commit()
    db.close()
    with pytest.raises(BackupError, match="stop the edge first and pass --force"):
        restore_backup(_state(live), tmp_path / "backup")
    assert _count(live) == 0  # nothing changed
    restore_backup(_state(live), tmp_path / "backup", force=True)
    assert _count(live) == 5


def test_restore_refuses_a_schema_newer_than_this_release(tmp_path: Path) -> None:
    live = tmp_path / "t.db"
    _live_writer(live, 1).close()
    make_backup(_state(live), tmp_path / "backup")
    live.unlink()
    with pytest.raises(BackupError, match="schema version 3 is newer than this release reads"):
        restore_backup(_state(live, version=2), tmp_path / "backup")
    assert not live.exists()
    restore_backup(_state(live, version=4), tmp_path / "backup")  # older: the service migrates
    assert _count(live) == 1


def test_restore_refuses_another_services_backup_and_a_damaged_manifest(tmp_path: Path) -> None:
    live = tmp_path / "t.db"
    _live_writer(live, 1).close()
    make_backup(_state(live), tmp_path / "backup")
    with pytest.raises(BackupError, match="a backup of the edge, not of the node"):
        restore_backup(_state(live, service="node"), tmp_path / "backup", force=True)
    manifest = tmp_path / "backup" / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "files": {"t.db": 1}}))
    with pytest.raises(BackupError, match="schema version 3, its manifest says 1"):
        restore_backup(_state(live), tmp_path / "backup", force=True)
    with pytest.raises(BackupError, match="not a backup"):
        restore_backup(_state(live), tmp_path, force=True)


def test_a_backup_never_writes_into_a_directory_that_holds_something(tmp_path: Path) -> None:
    live = tmp_path / "t.db"
    _live_writer(live, 1).close()
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "other").write_text("x")
    with pytest.raises(BackupError, match="not an empty directory"):
        make_backup(_state(live), tmp_path / "backup")


def test_the_dsn_password_leaves_the_command_line() -> None:
    bare, env = _split_password("postgresql://iop:s3cret@db.example:5433/iop?sslmode=require")
    assert bare == "postgresql://iop@db.example:5433/iop?sslmode=require"
    assert env == {"PGPASSWORD": "s3cret"}
    assert _split_password("postgresql:///iop") == ("postgresql:///iop", {})


def test_the_commands_report_what_they_did_and_why_they_refused(tmp_path: Path) -> None:
    live = tmp_path / "t.db"
    _live_writer(live, 2).close()
    out, err = io.StringIO(), io.StringIO()
    backup = argparse.Namespace(command="backup", path=tmp_path / "b")
    assert run_backup_command(backup, _state(live), out, err) == 0
    assert f"backed up the edge (t.db) into {tmp_path / 'b'}" in out.getvalue()
    restore = argparse.Namespace(command="restore", path=tmp_path / "b", force=False)
    assert run_backup_command(restore, _state(live), out, err) == 1
    assert err.getvalue().startswith("iop-edge: restore: would replace ")
    live.write_bytes(b"not a database, " * 512)  # one line, no traceback
    again = argparse.Namespace(command="backup", path=tmp_path / "c")
    assert run_backup_command(again, _state(live), out, err) == 1
    assert "iop-edge: backup: file is not a database" in err.getvalue()
    assert not (tmp_path / "c").exists()  # no half backup left behind
