"""The operator's credential commands: issue, revoke and list node tokens and API keys.

    token issue --node ID [--output FILE [--force]] [expiry]   token revoke TOKEN_ID   token list
    key issue --name NAME [--models a,b] [--max-concurrent N] [--operator] [limits] [expiry]
    token rotate TOKEN_ID / key rotate KEY_ID [--overlap 24h]    (``rotation_cli``)
    key update KEY_ID [--model M] [limits]       (limits: see ``key_limits_cli``)
    key revoke KEY_ID              key list                   (each takes --json)

A secret is printed once, by the command that issues it, and goes nowhere else:
not into the store (only its hash), not into listings, not into any log. With
``--output FILE`` a token goes only into FILE (mode 0600) and the command prints
where it went, so it never passes through a terminal or a shell's history. Each
command is a function of a store and output streams returning an exit code, so
tests drive them with a real store and a ``StringIO``; the console script only
parses arguments and opens the store.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from iop_control_plane.domain.credentials import (
    ApiKey,
    NodeToken,
    as_utc,
    new_api_key,
    new_node_token,
)
from iop_control_plane.domain.key_limits import NO_LIMITS, KeyLimits
from iop_control_plane.entrypoints import key_limits_cli, rotation_cli
from iop_control_plane.entrypoints.output import json_time as _json_time
from iop_control_plane.entrypoints.output import print_json, write_secret_file
from iop_control_plane.entrypoints.output import show_time as _show_time
from iop_control_plane.entrypoints.output import table as _table
from iop_control_plane.errors import CredentialError
from iop_control_plane.ports import CredentialStore

EXIT_OK = 0
EXIT_FAILED = 1

_PROG = "iop-control-plane"
_SHOWN_ONCE = "Copy it now: it will not be shown again (only its hash is stored)."

_Handler = Callable[[argparse.Namespace, CredentialStore, TextIO, TextIO], Awaitable[int]]
_HANDLER = "credential_command"  # the Namespace attribute naming the chosen command


def _fail(err: TextIO | None, exc: CredentialError) -> int:
    print(f"{_PROG}: {exc}", file=err if err is not None else sys.stderr)
    return EXIT_FAILED


def _when(now: datetime | None) -> datetime:
    return datetime.now(UTC) if now is None else as_utc(now)


def _show_models(models: Sequence[str]) -> str:
    return ",".join(models) if models else "(all)"


def _show_limit(max_concurrent: int) -> str:
    return str(max_concurrent) if max_concurrent else "unlimited"


# --- node tokens -------------------------------------------------------------------------


async def issue_token(
    store: CredentialStore,
    out: TextIO,
    node_id: str,
    *,
    err: TextIO | None = None,
    now: datetime | None = None,
    output: Path | None = None,
    force: bool = False,
    as_json: bool = False,
    expires_at: datetime | None = None,
) -> int:
    """Issue a token for ``node_id`` (valid until ``expires_at``, or for good); print its
    plaintext the one time it is ever shown, or write it to ``output`` (0600) and print
    only where it went.

    The file is written before the token is stored, so a refused path (it exists, the
    directory is missing) leaves no live token that nobody holds.
    """
    try:
        issued = new_node_token(node_id, _when(now), expires_at=expires_at)
        if output is not None:
            await asyncio.to_thread(write_secret_file, output, issued.plaintext, force=force)
    except CredentialError as exc:
        return _fail(err, exc)
    except FileExistsError:
        return _fail(err, CredentialError(f"{output} exists; --force replaces it"))
    except OSError as exc:
        return _fail(err, CredentialError(f"cannot write the token to {output}: {exc}"))
    try:
        await store.add_node_token(issued.token)
    except CredentialError as exc:
        if output is not None:
            await asyncio.to_thread(output.unlink, missing_ok=True)
        return _fail(err, exc)
    token = issued.token
    if as_json:
        shown = {"token": issued.plaintext} if output is None else {"output": str(output)}
        print_json({**_token_json(token), **shown}, out)
    elif output is not None:
        print(f"Wrote node token {token.token_id} for node {token.node_id!r} to {output}", file=out)
    else:
        print(f"Issued node token {token.token_id} for node {token.node_id!r}:", file=out)
        print(f"\n{issued.plaintext}\n", file=out)
        print(_SHOWN_ONCE, file=out)
    return EXIT_OK


async def revoke_token(
    store: CredentialStore,
    out: TextIO,
    token_id: str,
    *,
    err: TextIO | None = None,
    now: datetime | None = None,
    as_json: bool = False,
) -> int:
    """Revoke a token by id; an unknown id fails, a repeat reports the first revocation."""
    when = _when(now)
    try:
        token = await store.revoke_node_token(token_id, when)
    except CredentialError as exc:
        return _fail(err, exc)
    if as_json:
        print_json({**_token_json(token), "already_revoked": token.revoked_at != when}, out)
    elif token.revoked_at != when:
        print(
            f"Node token {token_id} was already revoked at {_show_time(token.revoked_at)}.",
            file=out,
        )
    else:
        print(f"Revoked node token {token_id} (node {token.node_id!r}).", file=out)
    return EXIT_OK


def _token_json(token: NodeToken) -> dict[str, Any]:
    # Field by field, never dataclasses.asdict: that would carry the hash along.
    return {
        "token_id": token.token_id,
        "node_id": token.node_id,
        "created_at": _json_time(token.created_at),
        "revoked_at": _json_time(token.revoked_at),
        **rotation_cli.expiry_json(token),
    }


async def list_tokens(store: CredentialStore, out: TextIO, *, as_json: bool = False) -> int:
    """Print every node token, revoked ones too; never a secret or a hash."""
    tokens = await store.list_node_tokens()
    if as_json:
        print_json([_token_json(token) for token in tokens], out)
    elif not tokens:
        print("No node tokens.", file=out)
    else:
        rows = [
            [
                t.token_id,
                t.node_id,
                _show_time(t.created_at),
                _show_time(t.revoked_at),
                rotation_cli.show_expiry(t),
            ]
            for t in tokens
        ]
        print(_table(["ID", "NODE", "CREATED", "REVOKED", "EXPIRES"], rows), file=out)
    return EXIT_OK


# --- API keys ----------------------------------------------------------------------------


async def issue_key(
    store: CredentialStore,
    out: TextIO,
    name: str,
    models: Sequence[str] = (),
    max_concurrent: int = 0,
    *,
    operator: bool = False,
    limits: KeyLimits = NO_LIMITS,
    weight: int = 1,
    priority: int = 0,
    err: TextIO | None = None,
    now: datetime | None = None,
    as_json: bool = False,
    expires_at: datetime | None = None,
) -> int:
    """Issue an API key (valid until ``expires_at``, or for good) and print its plaintext,
    the one time it is ever shown.

    ``operator``: the key sees every key's runs, files and batches at the edge;
    ``limits``, ``weight``, ``priority``: what the edge holds it to.
    """
    try:
        issued = new_api_key(
            name,
            models,
            max_concurrent,
            _when(now),
            operator=operator,
            limits=limits,
            weight=weight,
            priority=priority,
            expires_at=expires_at,
        )
        await store.add_api_key(issued.key)
    except CredentialError as exc:
        return _fail(err, exc)
    key = issued.key
    if as_json:
        print_json({**_key_json(key), "key": issued.plaintext}, out)
        return EXIT_OK
    print(
        f"Issued API key {key.key_id} named {key.name!r} "
        f"(models: {_show_models(key.models)}; "
        f"max concurrent: {_show_limit(key.max_concurrent)}"
        f"{'; operator' if key.operator else ''}; "
        f"limits: {key_limits_cli.show_limits(key)}; "
        f"expires: {rotation_cli.show_expiry(key)}):",
        file=out,
    )
    print(f"\n{issued.plaintext}\n", file=out)
    print(_SHOWN_ONCE, file=out)
    return EXIT_OK


async def revoke_key(
    store: CredentialStore,
    out: TextIO,
    key_id: str,
    *,
    err: TextIO | None = None,
    now: datetime | None = None,
    as_json: bool = False,
) -> int:
    """Revoke an API key by id; an unknown id fails, a repeat reports the first revocation."""
    when = _when(now)
    try:
        key = await store.revoke_api_key(key_id, when)
    except CredentialError as exc:
        return _fail(err, exc)
    if as_json:
        print_json({**_key_json(key), "already_revoked": key.revoked_at != when}, out)
    elif key.revoked_at != when:
        print(f"API key {key_id} was already revoked at {_show_time(key.revoked_at)}.", file=out)
    else:
        print(f"Revoked API key {key_id} ({key.name!r}).", file=out)
    return EXIT_OK


def _key_json(key: ApiKey) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "name": key.name,
        "models": list(key.models),
        "max_concurrent": key.max_concurrent,
        "operator": key.operator,
        "created_at": _json_time(key.created_at),
        "revoked_at": _json_time(key.revoked_at),
        **key_limits_cli.limits_json(key),
        **rotation_cli.expiry_json(key),
    }


async def update_key(
    store: CredentialStore,
    out: TextIO,
    args: argparse.Namespace,
    *,
    err: TextIO | None = None,
) -> int:
    """Change the policy of the key ``args.key_id`` as ``args`` (``key update``) say, and
    print what is stored now. Two updates of one key at once: the last one stands."""
    try:
        found = [key for key in await store.list_api_keys() if key.key_id == args.key_id]
        if not found:
            raise CredentialError(f"no API key with id {args.key_id!r}")
        key = await store.update_api_key(key_limits_cli.updated(found[0], args))
    except CredentialError as exc:
        return _fail(err, exc)
    if args.json:
        print_json(_key_json(key), out)
        return EXIT_OK
    print(
        f"Updated API key {key.key_id} ({key.name!r}): limits {key_limits_cli.show_limits(key)};"
        f" max concurrent {_show_limit(key.max_concurrent)}; weight {key.weight};"
        f" priority {key.priority}",
        file=out,
    )
    return EXIT_OK


async def list_keys(store: CredentialStore, out: TextIO, *, as_json: bool = False) -> int:
    """Print every API key and its policy, revoked ones too; never a secret or a hash."""
    keys = await store.list_api_keys()
    if as_json:
        print_json([_key_json(key) for key in keys], out)
    elif not keys:
        print("No API keys.", file=out)
    else:
        rows = [
            [
                k.key_id,
                k.name,
                _show_models(k.models),
                _show_limit(k.max_concurrent),
                "yes" if k.operator else "no",
                key_limits_cli.show_limits(k),
                f"{k.weight}/{k.priority}",
                _show_time(k.created_at),
                _show_time(k.revoked_at),
                rotation_cli.show_expiry(k),
            ]
            for k in keys
        ]
        headers = [
            "ID",
            "NAME",
            "MODELS",
            "MAX_CONCURRENT",
            "OPERATOR",
            "LIMITS",
            "WEIGHT/PRIORITY",
            "CREATED",
            "REVOKED",
            "EXPIRES",
        ]
        print(_table(headers, rows), file=out)
    return EXIT_OK


# --- argument parsing --------------------------------------------------------------------


def _model_list(text: str) -> list[str]:
    models = [part.strip() for part in text.split(",")]
    if not all(models):
        # Refuse rather than drop: "--models ''" silently meaning "every model" would be a trap.
        raise argparse.ArgumentTypeError(
            f"empty model name in {text!r}; leave --models out to allow every model"
        )
    return models


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (unlimited) or more, got {value}")
    return value


async def _run_token_issue(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await issue_token(
        store,
        out,
        args.node,
        err=err,
        output=args.output,
        force=args.force,
        as_json=args.json,
        expires_at=args.expires_at,
    )


async def _run_token_revoke(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await revoke_token(store, out, args.token_id, err=err, as_json=args.json)


async def _run_token_list(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await list_tokens(store, out, as_json=args.json)


async def _run_key_issue(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await issue_key(
        store,
        out,
        args.name,
        args.models,
        args.max_concurrent,
        operator=args.operator,
        limits=key_limits_cli.limits_from_args(args),
        weight=args.weight,
        priority=args.priority,
        err=err,
        as_json=args.json,
        expires_at=args.expires_at,
    )


async def _run_key_update(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await update_key(store, out, args, err=err)


async def _run_key_revoke(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await revoke_key(store, out, args.key_id, err=err, as_json=args.json)


async def _run_key_list(
    args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
) -> int:
    return await list_keys(store, out, as_json=args.json)


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``token ...`` and ``key ...`` on the console script's sub-command parser."""
    token = subparsers.add_parser("token", help="issue, revoke or list node tokens")
    token_actions = token.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    issue = token_actions.add_parser("issue", help="issue a node token (printed once)")
    issue.add_argument("--node", required=True, metavar="ID", help="the node it authenticates")
    issue.add_argument(
        "--output",
        type=Path,
        metavar="FILE",
        help="write the token to FILE (mode 0600) and print only where it went",
    )
    issue.add_argument("--force", action="store_true", help="with --output: replace FILE")
    rotation_cli.add_expiry_flags(issue)
    _json_flag(issue)
    issue.set_defaults(**{_HANDLER: _run_token_issue})
    revoke = token_actions.add_parser("revoke", help="revoke a node token")
    revoke.add_argument("token_id", metavar="TOKEN_ID", help="as shown by 'token list'")
    _json_flag(revoke)
    revoke.set_defaults(**{_HANDLER: _run_token_revoke})
    listing = token_actions.add_parser("list", help="list node tokens (never their secrets)")
    _json_flag(listing)
    listing.set_defaults(**{_HANDLER: _run_token_list})
    _json_flag(rotation_cli.add_rotate_parser(token_actions, "token", _HANDLER))

    key = subparsers.add_parser("key", help="issue, revoke or list API keys")
    key_actions = key.add_subparsers(dest="key_action", metavar="ACTION", required=True)
    issue = key_actions.add_parser("issue", help="issue an API key (printed once)")
    issue.add_argument("--name", required=True, help="who or what the key is for")
    issue.add_argument(
        "--models",
        type=_model_list,
        default=[],
        metavar="A,B",
        help="models the key may use (default: every model)",
    )
    issue.add_argument(
        "--max-concurrent",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="requests in flight at once (default: 0, unlimited)",
    )
    issue.add_argument(
        "--operator",
        action="store_true",
        help="an operator key: sees every key's runs, files and batches (the console's key)",
    )
    key_limits_cli.add_limit_flags(issue, update=False)
    rotation_cli.add_expiry_flags(issue)
    _json_flag(issue)
    issue.set_defaults(**{_HANDLER: _run_key_issue})
    update = key_limits_cli.add_update_parser(key_actions)
    _json_flag(update)
    update.set_defaults(**{_HANDLER: _run_key_update})
    revoke = key_actions.add_parser("revoke", help="revoke an API key")
    revoke.add_argument("key_id", metavar="KEY_ID", help="as shown by 'key list'")
    _json_flag(revoke)
    revoke.set_defaults(**{_HANDLER: _run_key_revoke})
    listing = key_actions.add_parser("list", help="list API keys (never their secrets)")
    _json_flag(listing)
    listing.set_defaults(**{_HANDLER: _run_key_list})
    _json_flag(rotation_cli.add_rotate_parser(key_actions, "key", _HANDLER))


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


async def run_command(
    args: argparse.Namespace,
    store: CredentialStore,
    out: TextIO,
    err: TextIO | None = None,
) -> int:
    """Run the credential command ``args`` names; ``err`` defaults to ``sys.stderr``."""
    handler: _Handler | None = getattr(args, _HANDLER, None)
    if handler is None:
        raise ValueError("args do not name a credential command (see add_commands)")
    return await handler(args, store, out, err if err is not None else sys.stderr)
