"""The `iop-control-plane` console script: the server, and the operator's commands.

iop-control-plane --config FILE                      run the server
iop-control-plane --config FILE token issue --node N issue a node token (shown once)
iop-control-plane --config FILE key issue --name N   issue an API key (shown once)
iop-control-plane --config FILE config reload        re-read the fleet file (SIGHUP)
iop-control-plane --config FILE node add|retire|list node lifecycle (node_commands)
iop-control-plane --config FILE backup|restore PATH  the credentials' backup (iop_proto.backup)
iop-control-plane config check FLEET_FILE            validate without applying

Every command but `config check FILE` runs on the control-plane's host: it opens the
server's database and signals the server through its pid file. With a `postgres`
section the store is shared: the commands run on any host with the same settings, and
every control-plane on that store sees the change within `credentials_poll_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TextIO

from iop_control_plane import __version__
from iop_control_plane.adapters.backup_state import control_plane_state
from iop_control_plane.adapters.fleet_file import load_fleet_file
from iop_control_plane.adapters.stores import open_store
from iop_control_plane.bootstrap import build
from iop_control_plane.entrypoints import cli, node_commands
from iop_control_plane.errors import CredentialError, FleetConfigError
from iop_control_plane.settings import ControlPlaneSettings
from iop_proto.backup import add_backup_commands, is_backup_command, run_backup_command
from iop_proto.errors import SettingsError
from iop_proto.postgres import StorageUnavailable
from iop_proto.service import load_settings, run_service
from iop_proto.service.runner import EXIT_BAD_SETTINGS, EXIT_FAILED, EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-control-plane",
        description="The IOP control-plane: node tokens, API keys and fleet configuration.",
    )
    parser.add_argument("--config", type=Path, help="settings YAML file")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="run the server (the default)")
    config = commands.add_parser("config", help="check or reload the fleet file")
    config_actions = config.add_subparsers(dest="action", required=True)
    check = config_actions.add_parser("check", help="validate a fleet file without applying it")
    check.add_argument("file", type=Path, nargs="?", help="default: the settings' fleet_file")
    config_actions.add_parser(
        "reload",
        help="make the running server re-read its fleet file (on the control-plane's host)",
    )
    cli.add_commands(commands)
    node_commands.add_commands(commands)
    add_backup_commands(commands)
    return parser


def check_fleet(path: Path, out: TextIO, err: TextIO) -> int:
    """Validate ``path`` as a fleet file; print warnings, or every problem found."""
    try:
        parsed = load_fleet_file(path)
    except FleetConfigError as exc:
        print(exc, file=err)
        return EXIT_FAILED
    for warning in parsed.warnings:
        print(f"warning: {warning}", file=err)
    spec = parsed.spec
    print(f"{path}: valid ({len(spec.models)} models, {len(spec.nodes)} nodes)", file=out)
    return EXIT_OK


def reload_server(settings: ControlPlaneSettings, out: TextIO, err: TextIO) -> int:
    """Check the fleet file here (to show the reasons), then SIGHUP the running server."""
    if check_fleet(settings.fleet_file, out, err) != EXIT_OK:
        print("not reloaded: the running server keeps its configuration", file=err)
        return EXIT_FAILED
    pid_file = settings.resolved_pid_file
    pid = node_commands.signal_reload(pid_file)
    if pid is None:
        print(f"no running control-plane found through {pid_file}", file=err)
        return EXIT_FAILED
    print(f"reload signalled to pid {pid}", file=out)
    return EXIT_OK


async def _run_credential_command(args: argparse.Namespace, settings: ControlPlaneSettings) -> int:
    """One command against the store the server uses (its SQLite file, or the shared
    PostgreSQL store, where every running control-plane sees the change)."""
    try:
        store = await open_store(settings)
    except (StorageUnavailable, CredentialError) as exc:
        print(f"iop-control-plane: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        if node_commands.is_node_command(args):
            context = node_commands.NodeContext(
                settings.fleet_file,
                settings.resolved_pid_file,
                shared_store=settings.postgres is not None,
            )
            return await node_commands.run_command(args, store, context, sys.stdout, sys.stderr)
        return await cli.run_command(args, store, sys.stdout)
    except StorageUnavailable as exc:
        print(f"iop-control-plane: {exc}; nothing was changed after it", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await store.aclose()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config" and args.action == "check" and args.file is not None:
        return check_fleet(args.file, sys.stdout, sys.stderr)
    if args.config is None:
        print("iop-control-plane: --config FILE is required", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    if args.command in (None, "serve"):
        return run_service(
            "control-plane",
            __version__,
            ControlPlaneSettings,
            build,
            ["--config", str(args.config)],
        )
    try:
        settings = load_settings(ControlPlaneSettings, args.config)
    except SettingsError as exc:
        print(f"iop-control-plane: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    if args.command == "config":
        if args.action == "check":
            return check_fleet(settings.fleet_file, sys.stdout, sys.stderr)
        return reload_server(settings, sys.stdout, sys.stderr)
    if is_backup_command(args):
        return run_backup_command(args, control_plane_state(settings), sys.stdout, sys.stderr)
    return asyncio.run(_run_credential_command(args, settings))


if __name__ == "__main__":
    raise SystemExit(main())
