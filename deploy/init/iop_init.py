"""The compose stack's one-shot set-up: certificates and node tokens in named volumes.

The `iop-init` service of docker-compose.yml runs this before anything else starts, and an
operator runs it again to add a node (`docker compose run --rm iop-init --node node-c`).
Every step creates only what is missing, so a second run changes nothing:

1. The fleet CA and one certificate per identity (CN = identity, OU = role), made by
   tools/devcerts.py in the private PKI directory: the only place the CA key exists.
   Without `--identity`, devcerts' development set plus one leaf per `--node` (each also
   valid for localhost: the compose stack); with `--identity NAME:ROLE` only those and the
   `--node`s, for real hosts, named by `--san IDENTITY=DNS:name|IP:addr` (passed through).
2. The CA certificate and each identity's certificate and key, copied into the certificate
   directory that the services mount read-only. Never the CA key.
3. A node token per node, issued by `iop-control-plane token issue` (run in this process)
   into the control-plane's database and written to `<tokens>/<node>.token` (mode 0600).
   A token file is issued anew when the database holds no live token for its node (its
   volume was removed, say).

Started as root, it gives its directories to the uid the services run as and drops to it
before writing anything, so every file belongs to that user. `--bundle NODE` then writes a
tar of what a remote node host needs (deploy/node-host/) to standard output; progress
always goes to standard error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import BinaryIO

from iop_control_plane.entrypoints.main import main as control_plane_main
from iop_control_plane.settings import ControlPlaneSettings
from iop_proto.errors import SettingsError
from iop_proto.files import write_file
from iop_proto.service import load_settings

SERVICE_USER = "10001:10001"  # the USER of every service image
CA_KEY = "ca.key"
_NODE_ID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label, as devcerts wants


class InitError(Exception):
    """A step failed; the message says which and why (never a secret)."""


def log(message: str) -> None:
    print(f"iop-init: {message}", file=sys.stderr, flush=True)


def take_ownership(directories: list[Path], uid: int, gid: int) -> None:
    """As root: hand the directories (and anything already in them) to ``uid``, then become it."""
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
        for path in (directory, *directory.rglob("*")):
            os.chown(path, uid, gid, follow_symlinks=False)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def find_devcerts(here: Path) -> Path:
    """devcerts.py beside this file (the iop-init image) or in the checkout's tools/."""
    for candidate in (here / "devcerts.py", here.parent.parent / "tools" / "devcerts.py"):
        if candidate.is_file():
            return candidate
    return here / "devcerts.py"  # the error then names the image's layout


def devcerts_arguments(args: argparse.Namespace, nodes: list[str]) -> list[str]:
    """devcerts' flags: the identities (dev set unless some are named), SANs, reissues."""
    command = ["--days", str(args.days)] + ([] if args.identities else ["--dev"])
    for identity in args.identities:
        command += ["--identity", identity]
    for node in nodes:
        if not any(i.partition(":")[0] == node for i in args.identities):
            command += ["--identity", f"{node}:node"]
    for san in args.sans:
        command += ["--san", san]
    for name in args.reissue:
        command += ["--reissue", name]
    return command


def make_certificates(devcerts: Path, pki: Path, arguments: list[str]) -> None:
    """The CA and every leaf in ``pki``; devcerts keeps what exists and issues what is missing."""
    if not devcerts.is_file():
        raise InitError(f"{devcerts} is not there; pass --devcerts PATH/TO/tools/devcerts.py")
    pki.mkdir(parents=True, exist_ok=True)
    pki.chmod(0o700)  # the CA key's directory: for this program only
    command = [sys.executable, str(devcerts), "--out", str(pki), *arguments]
    # devcerts prints its progress on stdout, which belongs to --bundle's tar.
    result = subprocess.run(command, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise InitError(f"making certificates in {pki} failed (devcerts exit {result.returncode})")


def publish_certificates(pki: Path, certs: Path) -> list[Path]:
    """Copy the CA certificate and every leaf pair, but not the CA key, into ``certs``."""
    certs.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sorted(pki.iterdir()):
        if source.name.startswith(".") or source.suffix not in {".pem", ".key"}:
            continue  # devcerts' temporary files, and anything that is not a credential
        if source.name == CA_KEY:
            continue
        target = certs / source.name
        data = source.read_bytes()
        if target.is_file() and target.read_bytes() == data:
            continue
        write_file(target, data, 0o600 if source.suffix == ".key" else 0o644, force=True)
        written.append(target)
    return written


def control_plane_cli(config: Path, *args: str) -> str:
    """`iop-control-plane --config CONFIG ARGS...`, in this process (one start-up, not one each).

    The console script's own `main`, with the same arguments; its stdout is returned.
    """
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = control_plane_main(["--config", str(config), *args])
    except SystemExit as exc:  # argparse refused the arguments
        code = exc.code if isinstance(exc.code, int) else 1
    if code != 0:
        # stderr only: stdout of `token issue` may hold a token.
        raise InitError(f"`iop-control-plane {' '.join(args)}` failed: {err.getvalue().strip()}")
    return out.getvalue()


def issue_tokens(config: Path, tokens: Path, nodes: list[str]) -> list[Path]:
    """A token file per node, issued when absent or when the database has no live token."""
    tokens.mkdir(parents=True, exist_ok=True)
    listed = json.loads(control_plane_cli(config, "token", "list", "--json"))
    live = {token["node_id"] for token in listed if token["revoked_at"] is None}
    written = []
    for node in nodes:
        path = tokens / f"{node}.token"
        present = path.is_file() and bool(path.read_text().strip())
        if present and node in live:
            continue
        if present:
            log(f"the database has no live token for {node}: issuing a new one")
        # the command writes the file itself (0600, atomically): the token never passes here
        control_plane_cli(
            config, "token", "issue", "--node", node, "--output", str(path), "--force"
        )
        written.append(path)
    return written


def bundle(node: str, certs: Path, tokens: Path, uid: int, gid: int, out: BinaryIO) -> None:
    """A tar of a node host's files, in deploy/node-host/'s layout, owned by ``uid``."""
    members = [
        ("certs/ca.pem", certs / "ca.pem", 0o644),
        ("certs/node.pem", certs / f"{node}.pem", 0o644),
        ("certs/node.key", certs / f"{node}.key", 0o600),
        ("node.token", tokens / f"{node}.token", 0o600),
    ]
    now = int(time.time())
    with tarfile.open(fileobj=out, mode="w|") as archive:
        for name, source, mode in members:
            data = source.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, gid, now
            archive.addfile(info, io.BytesIO(data))


def node_id(text: str) -> str:
    if not _NODE_ID.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a node id (a lower-case DNS label)")
    return text


def user_ids(text: str) -> tuple[int, int]:
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not UID:GID")
    return int(uid), int(gid)


def build_parser() -> argparse.ArgumentParser:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(
        prog="iop-init", description="Create the stack's certificates and node tokens."
    )
    parser.add_argument("--node", dest="nodes", type=node_id, action="append", default=[])
    parser.add_argument("--config", type=Path, default=Path("/etc/iop/control-plane.yaml"))
    parser.add_argument("--pki", type=Path, default=Path("/var/lib/iop/pki"), help="CA key here")
    parser.add_argument("--certs", type=Path, default=Path("/certs"))
    parser.add_argument("--tokens", type=Path, default=Path("/tokens"))
    parser.add_argument("--user", type=user_ids, default=user_ids(SERVICE_USER), help="UID:GID")
    parser.add_argument("--days", type=int, default=365, help="validity of new certificates")
    parser.add_argument(
        "--identity",
        dest="identities",
        action="append",
        default=[],
        metavar="NAME:ROLE",
        help="certificates for these identities (and each --node) only, instead of the dev set",
    )
    parser.add_argument(
        "--san",
        dest="sans",
        action="append",
        default=[],
        metavar="IDENTITY=DNS:name|IDENTITY=IP:addr",
        help="a name peers dial IDENTITY by (repeatable; passed to devcerts)",
    )
    parser.add_argument(
        "--reissue", action="append", default=[], metavar="NAME", help="replace NAME's leaf"
    )
    parser.add_argument(
        "--devcerts",
        type=Path,
        default=find_devcerts(here),
        help="tools/devcerts.py (default: beside this file, else the checkout's tools/)",
    )
    parser.add_argument("--bundle", type=node_id, metavar="NODE", help="tar of NODE's files")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    nodes = list(dict.fromkeys([*args.nodes, *([args.bundle] if args.bundle else [])]))
    try:
        settings = load_settings(ControlPlaneSettings, args.config)
    except SettingsError as exc:
        log(f"error: {exc}")
        return 1
    uid, gid = args.user
    try:
        if os.geteuid() == 0 and (uid, gid) != (0, 0):
            take_ownership([args.pki, args.certs, args.tokens, settings.database.parent], uid, gid)
        make_certificates(args.devcerts, args.pki, devcerts_arguments(args, nodes))
        for path in publish_certificates(args.pki, args.certs):
            log(f"published {path}")
        for path in issue_tokens(args.config, args.tokens, nodes):
            log(f"wrote a node token to {path}")
        if args.bundle:
            bundle(args.bundle, args.certs, args.tokens, uid, gid, sys.stdout.buffer)
            log(f"wrote the files of node {args.bundle} to standard output (a tar)")
    except (InitError, OSError) as exc:
        log(f"error: {exc}")
        return 1
    log("certificates and node tokens are in place")
    return 0


if __name__ == "__main__":
    sys.exit(main())
