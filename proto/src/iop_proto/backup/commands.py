"""``backup PATH`` and ``restore PATH [--force]``: the same two commands on every service's
console script (``iop-control-plane``, ``iop-edge``, ``iop-node``).

    iop-edge --config FILE backup PATH      copy the live state into the new directory PATH
    iop-edge --config FILE restore PATH     put it back (the service stopped; --force)

``service_main`` is the console script of a service with no other commands: without a
command it runs the server, as before, so ``iop-edge --config FILE`` is unchanged.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from iop_proto.backup.archive import ServiceState, make_backup, restore_backup
from iop_proto.backup.errors import BackupError
from iop_proto.errors import SettingsError
from iop_proto.service.runner import (
    EXIT_BAD_SETTINGS,
    EXIT_FAILED,
    EXIT_OK,
    ServiceFactory,
    SettingsT,
    run_service,
)
from iop_proto.service.settings import load_settings

_COMMANDS = ("backup", "restore")


def add_backup_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``backup`` and ``restore`` on a console script's sub-command parser."""
    backup = subparsers.add_parser("backup", help="copy the service's state while it runs")
    backup.add_argument("path", type=Path, metavar="PATH", help="a new (or empty) directory")
    restore = subparsers.add_parser("restore", help="put a backup's state back")
    restore.add_argument("path", type=Path, metavar="PATH", help="a directory made by backup")
    restore.add_argument(
        "--force",
        action="store_true",
        help="replace the state files that exist (stop the service first)",
    )


def is_backup_command(args: argparse.Namespace) -> bool:
    return getattr(args, "command", None) in _COMMANDS


def run_backup_command(
    args: argparse.Namespace, state: ServiceState, out: TextIO, err: TextIO
) -> int:
    """Run the ``backup`` or ``restore`` that ``args`` names against ``state``."""
    try:
        if args.command == "backup":
            manifest = make_backup(state, args.path)
            what = ", ".join(manifest.files) or "no SQLite file"
            if manifest.postgres is not None:
                what += " and the PostgreSQL store"
            print(f"backed up the {state.service} ({what}) into {args.path}", file=out)
        else:
            manifest = restore_backup(state, args.path, force=args.force)
            print(
                f"restored the {state.service}'s backup of {manifest.created_at} "
                f"(release {manifest.release}) from {args.path}; start the {state.service}",
                file=out,
            )
    except BackupError as exc:
        print(f"iop-{state.service}: {args.command}: {exc}", file=err)
        return EXIT_FAILED
    except (OSError, sqlite3.Error) as exc:  # a path not ours to read or write, a full disk
        print(f"iop-{state.service}: {args.command}: {exc}", file=err)
        return EXIT_FAILED
    return EXIT_OK


def service_main(
    name: str,
    version: str,
    settings_model: type[SettingsT],
    build: ServiceFactory[SettingsT],
    state_of: Callable[[SettingsT], ServiceState],
    argv: list[str] | None = None,
) -> int:
    """The console script: ``serve`` (the default), ``backup PATH`` or ``restore PATH``."""
    parser = argparse.ArgumentParser(prog=f"iop-{name}", description=f"The IOP {name} service.")
    parser.add_argument("--config", type=Path, required=True, help="settings YAML file")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="run the server (the default)")
    add_backup_commands(commands)
    args = parser.parse_args(argv)
    if not is_backup_command(args):
        return run_service(name, version, settings_model, build, ["--config", str(args.config)])
    try:
        settings = load_settings(settings_model, args.config)
    except SettingsError as exc:
        print(f"iop-{name}: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    return run_backup_command(args, state_of(settings), sys.stdout, sys.stderr)
