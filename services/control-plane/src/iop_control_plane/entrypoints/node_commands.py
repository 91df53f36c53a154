"""The operator's node lifecycle commands: add, retire and list nodes.

    node add ID [--output TOKEN_FILE] [--config-output FILE] [--edge HOST:PORT]
                                                            a token file, the node's settings file
    node retire ID                                          out of the fleet, tokens revoked
    node list                                               tokens, fleet, connection state
    (each takes --json)

They run on the control-plane's host: they use its database (tokens, retirements and
the connection states edges report, see ``domain.nodes``) and its pid file. The running
server notices a change in the database within ``credentials_poll_s`` (as it does for
``token revoke``) and pushes it to the edges; ``node retire`` also signals it to reload.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from iop_control_plane.adapters.fleet_file import load_fleet_file
from iop_control_plane.domain.credentials import new_node_token
from iop_control_plane.domain.fleet import FleetSpec
from iop_control_plane.domain.nodes import unserved_models
from iop_control_plane.entrypoints.node_config import (
    NODE_CERTS_DIR,
    NodeHostPaths,
    node_settings,
    render,
)
from iop_control_plane.entrypoints.output import (
    json_time,
    print_json,
    show_time,
    table,
)
from iop_control_plane.errors import CredentialError, FleetConfigError
from iop_control_plane.ports import CredentialStore
from iop_proto.files import write_file

EXIT_OK = 0
EXIT_FAILED = 1
_PROG = "iop-control-plane"
_NODE_ID = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")  # the fleet file's ids
_HANDLER = "node_command"

WHERE = (
    "Run on the control-plane's host: the commands use its database and pid file "
    "(the same --config as the server)."
)


@dataclass(frozen=True, slots=True)
class NodeContext:
    """What the node commands need besides the store: the server's files."""

    fleet_file: Path
    pid_file: Path
    shared_store: bool = False  # PostgreSQL: every control-plane on it sees the change


def signal_reload(pid_file: Path) -> int | None:
    """SIGHUP the running server named by ``pid_file``; its pid, or None if none runs."""
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGHUP)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    return pid


def _fleet(path: Path, err: TextIO) -> FleetSpec | None:
    """The fleet file as the server would read it, or None (with why) when it cannot."""
    try:
        return load_fleet_file(path).spec
    except FleetConfigError as exc:
        print(f"{_PROG}: warning: {exc}", file=err)
        return None


def _fail(err: TextIO, message: str) -> int:
    print(f"{_PROG}: {message}", file=err)
    return EXIT_FAILED


# --- node add --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddOptions:
    """Where ``node add`` writes, and what the node's settings file says."""

    output: Path | None = None  # the token, on this host; default ./ID.token
    config_output: Path | None = None  # the node's settings file; default: stdout
    edge: tuple[str, int] | None = None
    paths: NodeHostPaths = field(default_factory=NodeHostPaths)
    force: bool = False


async def add_node(
    store: CredentialStore,
    context: NodeContext,
    out: TextIO,
    err: TextIO,
    node_id: str,
    options: AddOptions = AddOptions(),
    *,
    as_json: bool = False,
) -> int:
    """Admit ``node_id`` (again, if it was retired), write a new token to a file and the
    node's settings file (with the node host's paths) to another or to ``out``.

    Printed without ``--config-output``, ``out`` gets the settings file alone (YAML), what
    else there is to say goes to ``err``: ``node add ID > node.yaml`` saves it. The fleet
    file is not edited: the node's providers are the operator's to write, and rewriting a
    commented YAML file would lose what the operator wrote around them.
    """
    if options.config_output is not None and options.edge is None:
        return _fail(err, "--config-output needs --edge HOST:PORT: where the node dials the edge")
    token_file = options.output or Path(f"{node_id}.token")
    now = datetime.now(UTC)
    fleet = _fleet(context.fleet_file, err)
    node = fleet.node(node_id) if fleet is not None else None
    settings = node_settings(node_id, options.edge, options.paths)
    text = render(settings, issued_at=now, fleet_file=context.fleet_file, node=node)
    config_file = options.config_output
    if config_file is not None:
        failed = await _write(err, config_file, text, options.force, 0o644, "the settings")
        if failed:
            return failed
    issued = new_node_token(node_id, now)
    failed = await _write(
        err, token_file, f"{issued.plaintext}\n", options.force, 0o600, "the token"
    )
    if not failed:
        try:
            await store.add_node_token(issued.token)
        except CredentialError as exc:
            await asyncio.to_thread(token_file.unlink, missing_ok=True)
            failed = _fail(err, str(exc))
    if failed:
        if config_file is not None:
            await asyncio.to_thread(config_file.unlink, missing_ok=True)
        return failed
    was_retired = await store.unretire_node(node_id)
    if as_json:
        print_json(
            {
                "node_id": node_id,
                "token_id": issued.token.token_id,
                "token_file": str(token_file),
                "config_file": None if config_file is None else str(config_file),
                "was_retired": was_retired,
                "in_fleet_file": node is not None,
                "fleet_file": str(context.fleet_file),
                "node_config": settings,
            },
            out,
        )
        return EXIT_OK
    notes = err if config_file is None else out  # stdout: the settings file alone
    written = "" if config_file is None else f" and its settings file to {config_file}"
    print(f"Wrote the token of node {node_id!r} to {token_file}{written}.", file=notes)
    if config_file is None:
        print(text, end="", file=out)
    if was_retired:
        print(f"Node {node_id!r} was retired: it is admitted again.", file=notes)
    print(
        f"On the node's host: the token goes to {settings['token_file']}, the settings file "
        "to /etc/iop/node.yaml.",
        file=notes,
    )
    listed = f"lists {node_id!r}: it can register now"
    if node is None:
        listed = f"does not list {node_id!r} yet: add it under nodes: (the settings file's "
        listed += f"last comment shows how), then `{_PROG} config reload`"
    print(f"{context.fleet_file} {listed}.", file=notes)
    return EXIT_OK


async def _write(err: TextIO, path: Path, text: str, force: bool, mode: int, what: str) -> int:
    """Write a file ``add_node`` makes; EXIT_OK, or EXIT_FAILED said on ``err``."""
    try:
        await asyncio.to_thread(write_file, path, text.encode(), mode, force=force)
    except FileExistsError:
        return _fail(err, f"{path} exists; --force replaces it (a node using it stops)")
    except OSError as exc:
        return _fail(err, f"cannot write {what} to {path}: {exc}")
    return EXIT_OK


# --- node retire -----------------------------------------------------------------------


async def retire_node(
    store: CredentialStore,
    context: NodeContext,
    out: TextIO,
    err: TextIO,
    node_id: str,
    *,
    as_json: bool = False,
) -> int:
    """Take ``node_id`` out of the fleet: retired in the database (its providers leave the
    served config, its registrations are refused), every live token revoked, and the
    running server told to reload, which pushes both to the edges: they drop its
    connection and their catalogs forget its providers."""
    now = datetime.now(UTC)
    tokens = [t for t in await store.list_node_tokens() if t.node_id == node_id]
    fleet = _fleet(context.fleet_file, err)
    in_fleet = fleet is not None and fleet.node(node_id) is not None
    states = await store.node_states()
    if not tokens and not in_fleet and node_id not in states:
        return _fail(err, f"no node {node_id!r}: no token, not in {context.fleet_file}")
    retired_at = await store.retire_node(node_id, now)
    revoked = [t.token_id for t in tokens if not t.revoked]
    for token_id in revoked:
        await store.revoke_node_token(token_id, now)
    pid = signal_reload(context.pid_file)
    orphans = unserved_models(fleet, await store.retired_nodes()) if fleet else []
    if as_json:
        print_json(
            {
                "node_id": node_id,
                "retired_at": json_time(retired_at),
                "revoked_token_ids": revoked,
                "reload_signalled_pid": pid,
                "in_fleet_file": in_fleet,
                "models_without_provider": orphans,
            },
            out,
        )
        return EXIT_OK
    again = "" if retired_at == now else f" (retired since {show_time(retired_at)})"
    print(f"Retired node {node_id!r}{again}; revoked {len(revoked)} token(s).", file=out)
    if pid is not None:
        print(f"Reload signalled to pid {pid}: edges drop the node and its providers.", file=out)
    elif context.shared_store:
        print(
            "Every control-plane on the shared store applies this within its "
            "credentials_poll_s: edges drop the node and its providers.",
            file=out,
        )
    else:
        print(
            f"No running control-plane found through {context.pid_file}: "
            "it applies this when it starts.",
            file=out,
        )
    if in_fleet:
        print(
            f"{context.fleet_file} still lists {node_id!r}; it stays retired, but remove it "
            "(and its providers from models) when you next edit the file.",
            file=out,
        )
    if orphans:
        print(
            f"Models left with no provider: {', '.join(orphans)}. The catalog shows them "
            f"unavailable until {context.fleet_file} gives them a provider or drops them.",
            file=out,
        )
    return EXIT_OK


# --- node list -------------------------------------------------------------------------


async def node_rows(store: CredentialStore, fleet: FleetSpec | None) -> list[dict[str, Any]]:
    """Every node known to the fleet file, the tokens, the retirements or an edge's report."""
    tokens = await store.list_node_tokens()
    retired = await store.retired_nodes()
    states = await store.node_states()
    listed = [n.id for n in fleet.nodes] if fleet is not None else []
    known = dict.fromkeys([*listed, *(t.node_id for t in tokens), *retired, *states])
    rows = []
    for node_id in known:
        state = states.get(node_id)
        if node_id in retired:
            status = "retired"
        elif state is None:
            status = "never connected"
        else:
            status = "connected" if state.connected else "disconnected"
        mine = [t for t in tokens if t.node_id == node_id]
        rows.append(
            {
                "node_id": node_id,
                "state": status,
                "in_fleet_file": node_id in listed if fleet is not None else None,
                "live_tokens": [t.token_id for t in mine if not t.revoked],
                "revoked_tokens": [t.token_id for t in mine if t.revoked],
                "retired_at": json_time(retired.get(node_id)),
                "edge_id": state.edge_id if state else None,
                "connected": state.connected if state else False,
                "since": json_time(state.since) if state else None,
                "peer_address": state.peer_address if state else None,
                "detail": state.detail if state else None,
                "reported_at": json_time(state.reported_at) if state else None,
            }
        )
    return rows


def _since(moment: str | None) -> str:
    return show_time(datetime.fromisoformat(moment) if moment else None)


async def list_nodes(
    store: CredentialStore, context: NodeContext, out: TextIO, err: TextIO, *, as_json: bool
) -> int:
    rows = await node_rows(store, _fleet(context.fleet_file, err))
    if as_json:
        print_json(rows, out)
        return EXIT_OK
    if not rows:
        print("No nodes.", file=out)
        return EXIT_OK
    cells = [
        [
            r["node_id"],
            r["state"],
            {True: "yes", False: "no", None: "?"}[r["in_fleet_file"]],
            str(len(r["live_tokens"])),
            r["edge_id"] or "-",
            _since(r["retired_at"] or r["since"]),
            r["peer_address"] or "-",
            r["detail"] or "",
        ]
        for r in rows
    ]
    headers = ["NODE", "STATE", "IN_FLEET", "TOKENS", "EDGE", "SINCE", "FROM", "DETAIL"]
    print(table(headers, cells), file=out)
    return EXIT_OK


# --- argument parsing ------------------------------------------------------------------


def _node_id(text: str) -> str:
    if not _NODE_ID.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a node id (lower-case letters, digits, - _)"
        )
    return text


def _edge_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


_Handler = Callable[
    [argparse.Namespace, CredentialStore, NodeContext, TextIO, TextIO], Awaitable[int]
]


async def _run_add(
    args: argparse.Namespace, store: CredentialStore, ctx: NodeContext, out: TextIO, err: TextIO
) -> int:
    paths = NodeHostPaths(args.node_certs_dir, args.node_token_path)
    options = AddOptions(args.output, args.config_output, args.edge, paths, args.force)
    return await add_node(store, ctx, out, err, args.node_id, options, as_json=args.json)


async def _run_retire(
    args: argparse.Namespace, store: CredentialStore, ctx: NodeContext, out: TextIO, err: TextIO
) -> int:
    return await retire_node(store, ctx, out, err, args.node_id, as_json=args.json)


async def _run_list(
    args: argparse.Namespace, store: CredentialStore, ctx: NodeContext, out: TextIO, err: TextIO
) -> int:
    return await list_nodes(store, ctx, out, err, as_json=args.json)


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``node add|retire|list`` on the console script's sub-command parser."""
    node = subparsers.add_parser(
        "node", help="add, retire or list nodes (on the control-plane's host)", description=WHERE
    )
    actions = node.add_subparsers(dest="node_action", metavar="ACTION", required=True)
    add = actions.add_parser(
        "add",
        help="issue a node's token to a file, and its settings file to save on its host",
        description=f"{WHERE} A retired node is admitted again.",
    )
    add.add_argument("node_id", type=_node_id, metavar="ID")
    for flag, metavar, text in (
        ("--output", "TOKEN_FILE", "the token, on this host (default: ./ID.token)"),
        ("--config-output", "FILE", "write the node's settings file there (needs --edge)"),
        ("--node-token-path", "PATH", "the token on the node's host (default: DIR/ID.token)"),
    ):
        add.add_argument(flag, type=Path, metavar=metavar, help=text)
    add.add_argument("--force", action="store_true", help="replace the files if they exist")
    add.add_argument(
        "--edge", type=_edge_address, metavar="HOST:PORT", help="where the node dials the edge"
    )
    add.add_argument(
        "--node-certs-dir",
        type=Path,
        default=NODE_CERTS_DIR,
        metavar="DIR",
        help=f"where ca.pem, ID.pem and ID.key are on the node's host (default {NODE_CERTS_DIR})",
    )
    add.set_defaults(**{_HANDLER: _run_add})
    retire = actions.add_parser(
        "retire",
        help="take a node out of the fleet: tokens revoked, edges drop it and its providers",
        description=f"{WHERE} `node add ID` admits it again.",
    )
    retire.add_argument("node_id", type=_node_id, metavar="ID")
    retire.set_defaults(**{_HANDLER: _run_retire})
    listing = actions.add_parser(
        "list",
        help="every node: state (connected, disconnected, retired), tokens, fleet file",
        description=f"{WHERE} The state is the last one an edge reported over its control "
        "link (with its time), also while the server is down.",
    )
    listing.set_defaults(**{_HANDLER: _run_list})
    for parser in (add, retire, listing):
        parser.add_argument("--json", action="store_true", help="print JSON")


def is_node_command(args: argparse.Namespace) -> bool:
    return getattr(args, _HANDLER, None) is not None


async def run_command(
    args: argparse.Namespace, store: CredentialStore, context: NodeContext, out: TextIO, err: TextIO
) -> int:
    handler: _Handler | None = getattr(args, _HANDLER, None)
    if handler is None:
        raise ValueError("args do not name a node command (see add_commands)")
    return await handler(args, store, context, out, err)
