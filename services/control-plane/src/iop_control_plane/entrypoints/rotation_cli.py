"""Expiry and rotation on the command line: ``--expires-in``/``--expires-at`` on ``issue``,
and ``token rotate`` / ``key rotate`` with an ``--overlap``.

    key rotate KEY_ID [--overlap 24h] [--json]
    token rotate TOKEN_ID [--overlap 24h] [--output FILE [--force]] [--json]

A rotation gives the credential a new secret under the same id and policy; the old
secret keeps working until the overlap ends (``domain.credentials.Rotation``), so the
clients (or the node) can be moved over one by one with no request refused. The new
secret is shown once, as by ``issue``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TextIO

from iop_control_plane.domain.credentials import (
    API_KEY_PREFIX,
    NODE_TOKEN_PREFIX,
    ApiKey,
    NodeToken,
    accepts,
    expires_after,
    new_secret,
    parse_duration,
    rotation_of,
)
from iop_control_plane.entrypoints.output import json_time, print_json, show_time, write_secret_file
from iop_control_plane.errors import CredentialError
from iop_control_plane.ports import CredentialStore

_PROG = "iop-control-plane"
_SHOWN_ONCE = "Copy it now: it will not be shown again (only its hash is stored)."


def show_expiry(record: NodeToken | ApiKey) -> str:
    """``key list``/``token list``'s EXPIRES cell: the moment, or ``never``; a rotation's
    previous secret still in its overlap is added as ``(old until ...)``."""
    shown = "never" if record.expires_at is None else show_time(record.expires_at)
    rotation = record.rotation
    if rotation is not None and accepts(record, rotation.previous_hash, datetime.now(UTC)):
        shown += f" (old until {show_time(rotation.until)})"
    return shown


def expiry_json(record: NodeToken | ApiKey) -> dict[str, Any]:
    """The expiry fields of a listing's JSON (also what a metric of expiry reads)."""
    rotation = record.rotation
    return {
        "expires_at": json_time(record.expires_at),
        "previous_secret_until": None if rotation is None else json_time(rotation.until),
    }


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except CredentialError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _moment(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone (add Z or +00:00)")
    return moment.astimezone(UTC)


class _ExpiresIn(argparse.Action):
    """``--expires-in 30d``: stored as the moment it names, counted from now."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            at = expires_after(datetime.now(UTC), float(values), None)
        except CredentialError as exc:
            parser.error(str(exc))
        namespace.expires_at = at


def add_expiry_flags(parser: argparse.ArgumentParser) -> None:
    """``--expires-in DURATION`` or ``--expires-at TIME`` on an ``issue`` command."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--expires-in",
        type=_duration,
        action=_ExpiresIn,
        dest="expires_at",
        metavar="DURATION",
        help="refused from this long after now on (30d, 12h, 90m; default: never)",
    )
    group.add_argument(
        "--expires-at",
        type=_moment,
        dest="expires_at",
        metavar="TIME",
        help="refused from this moment on (ISO 8601 with a zone, e.g. 2027-01-31T00:00Z)",
    )
    parser.set_defaults(expires_at=None)


async def rotate(
    store: CredentialStore,
    out: TextIO,
    kind: Literal["token", "key"],
    record_id: str,
    overlap_s: float,
    *,
    err: TextIO | None = None,
    now: datetime | None = None,
    output: Path | None = None,
    force: bool = False,
    as_json: bool = False,
) -> int:
    """Give the token or key ``record_id`` a new secret; the old one is accepted for
    ``overlap_s`` more seconds. The new secret is printed once (or, for a token, written
    to ``output``, 0600) before anyone could need it."""
    when = datetime.now(UTC) if now is None else now.astimezone(UTC)
    try:
        record: NodeToken | ApiKey
        if kind == "token":
            found_tokens = [t for t in await store.list_node_tokens() if t.token_id == record_id]
            if not found_tokens:
                raise CredentialError(f"no node token with id {record_id!r}")
            record = found_tokens[0]
            what = f"node token {record_id}"
        else:
            found_keys = [k for k in await store.list_api_keys() if k.key_id == record_id]
            if not found_keys:
                raise CredentialError(f"no API key with id {record_id!r}")
            record = found_keys[0]
            what = f"API key {record_id}"
        rotation = rotation_of(record, record.revoked, what, when, overlap_s)
        prefix = NODE_TOKEN_PREFIX if kind == "token" else API_KEY_PREFIX
        plaintext, secret_hash = new_secret(prefix)
        if output is not None:
            await asyncio.to_thread(write_secret_file, output, plaintext, force=force)
        if kind == "token":
            record = await store.rotate_node_token(record_id, secret_hash, rotation)
        else:
            record = await store.rotate_api_key(record_id, secret_hash, rotation)
    except CredentialError as exc:
        print(f"{_PROG}: {exc}", file=err if err is not None else sys.stderr)
        return 1
    except FileExistsError:
        print(f"{_PROG}: {output} exists; --force replaces it", file=err or sys.stderr)
        return 1
    except OSError as exc:
        print(f"{_PROG}: cannot write the token to {output}: {exc}", file=err or sys.stderr)
        return 1
    if as_json:
        shown = {"secret": plaintext} if output is None else {"output": str(output)}
        print_json({"id": record_id, **expiry_json(record), **shown}, out)
        return 0
    print(
        f"Rotated {what}: the old secret is accepted until {show_time(rotation.until)}; "
        f"expires: {show_expiry(record)}.",
        file=out,
    )
    if output is not None:
        print(f"Wrote the new secret to {output}", file=out)
    else:
        print(f"\n{plaintext}\n", file=out)
        print(_SHOWN_ONCE, file=out)
    return 0


def add_rotate_parser(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
    kind: Literal["token", "key"],
    handler_attribute: str,
) -> argparse.ArgumentParser:
    """``token rotate`` or ``key rotate`` on ``actions``; returns it (the caller adds --json)."""
    what = "node token" if kind == "token" else "API key"
    parser = actions.add_parser(
        "rotate", help=f"give a {what} a new secret, the old one kept for --overlap"
    )
    parser.add_argument(
        "record_id", metavar=f"{kind.upper()}_ID", help=f"as shown by '{kind} list'"
    )
    parser.add_argument(
        "--overlap",
        type=_duration,
        default=0.0,
        metavar="DURATION",
        help="how long the old secret is still accepted (24h, 30m; default 0: not at all)",
    )
    if kind == "token":
        parser.add_argument("--output", type=Path, metavar="FILE", help="write it to FILE (0600)")
        parser.add_argument("--force", action="store_true", help="with --output: replace FILE")

    async def run(
        args: argparse.Namespace, store: CredentialStore, out: TextIO, err: TextIO
    ) -> int:
        return await rotate(
            store,
            out,
            kind,
            args.record_id,
            args.overlap,
            err=err,
            output=getattr(args, "output", None),
            force=getattr(args, "force", False),
            as_json=args.json,
        )

    parser.set_defaults(**{handler_attribute: run})
    return parser
