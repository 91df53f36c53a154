"""What a copy of the live credentials database keeps, against what `backup` keeps.

Starts a real control-plane (throwaway CA, its own temporary directory), issues N API
keys through its CLI while it runs, then counts the keys in (a) a plain copy of
`credentials.db`, as `cp` makes it, and (b) `iop-control-plane backup` (where the
checkout has the command). Runs against any checkout: `.venv/bin/python
tools/hardening/backup_wal.py [N]` from its root.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trustme
import yaml

BIN = Path(sys.executable).parent


def _keys(database: Path) -> int | str:
    try:
        db = sqlite3.connect(database)
        try:
            return int(db.execute("SELECT COUNT(*) FROM api_keys").fetchone()[0])
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return f"unreadable ({exc})"


def main(count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ca = trustme.CA()
        ca.cert_pem.write_to_path(root / "ca.pem")
        leaf = ca.issue_cert("localhost", organization_unit_name="control-plane")
        leaf.cert_chain_pems[0].write_to_path(root / "cp.pem")
        leaf.private_key_pem.write_to_path(root / "cp.key")
        (root / "fleet.yaml").write_text(yaml.safe_dump({"models": [], "nodes": []}))
        database = root / "credentials.db"
        settings = {
            "fleet_file": str(root / "fleet.yaml"),
            "database": str(database),
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "tls": {
                "ca_file": str(root / "ca.pem"),
                "cert_file": str(root / "cp.pem"),
                "key_file": str(root / "cp.key"),
            },
        }
        config = root / "cp.yaml"
        config.write_text(yaml.safe_dump(settings))
        cli = [str(BIN / "iop-control-plane"), "--config", str(config)]
        log = root / "cp.log"
        with log.open("w") as sink:
            server = subprocess.Popen(cli, stderr=sink)
        try:
            deadline = time.monotonic() + 60
            while "ready:" not in log.read_text():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the control-plane did not start:\n" + log.read_text())
                time.sleep(0.1)
            for n in range(count):
                subprocess.run(
                    [*cli, "key", "issue", "--name", f"k{n}"], check=True, capture_output=True
                )
            shutil.copyfile(database, root / "copied.db")
            backup = subprocess.run(
                [*cli, "backup", str(root / "backup")], capture_output=True, text=True
            )
        finally:
            server.terminate()
            server.wait(30)
        print(f"keys issued while the control-plane ran: {count}")
        print(f"keys in a plain copy of credentials.db (cp): {_keys(root / 'copied.db')}")
        if backup.returncode == 0:
            print(
                f"keys in `iop-control-plane backup`: {_keys(root / 'backup' / 'credentials.db')}"
            )
        else:
            print(f"`iop-control-plane backup`: not available ({backup.stderr.strip()[-80:]})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
