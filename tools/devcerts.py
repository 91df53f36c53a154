"""Generate the development CA and one mTLS certificate per IOP service identity.

Every IOP service is both a TLS server and a TLS client of its neighbours, so each
leaf certificate carries serverAuth and clientAuth. A peer's identity is the
certificate's subject commonName and its role the organizationalUnitName (see
``iop_proto.tls``). Every leaf names ``DNS:<identity>`` (the docker compose service
name); ``--san IDENTITY=DNS:name`` / ``--san IDENTITY=IP:addr`` add the names peers
really dial on other hosts.

Without ``--identity`` the development set is issued (edge, control-plane, node-a,
node-b, worker), each also valid for ``localhost`` and 127.0.0.1 so that ``make run``
works on one machine. With ``--identity`` only the identities named are issued, and
without the loopback names: a fleet's CA should sign keys that somebody uses, for the
hosts they are used on.

Existing files are never overwritten without ``--force``: regenerating a CA behind
the back of running services, or of certificates copied elsewhere, breaks them in
ways that are slow to diagnose. Without ``--force`` only missing leaves are issued,
signed by the CA already on disk. A leaf on disk whose names or role differ from what
was asked is an error, not silently kept: ``--reissue NAME`` replaces just that leaf
(signed by the existing CA, every other file untouched), ``--force`` replaces everything.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from iop_proto.files import write_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # devcerts_x509, also when imported
from devcerts_x509 import (
    CA_NAME,
    DEFAULT_DAYS,
    DEFAULT_IDENTITIES,
    DEV_EXTRA_SANS,
    Authority,
    Identity,
    SanRequest,
    build_ca,
    build_leaf,
    describe_san,
    new_key,
    parse_identity,
    parse_san,
)

ROOT = Path(__file__).resolve().parent.parent


class DevCertsError(Exception):
    """A state of the output directory that the generator refuses to resolve by itself."""


def merge_identities(extra: Iterable[Identity]) -> list[Identity]:
    """The identities asked for, or the default set when none is.

    One name with two roles is a mistake, not a merge.
    """
    merged: dict[str, Identity] = {}
    for identity in extra:
        known = merged.setdefault(identity.name, identity)
        if known.role != identity.role:
            raise DevCertsError(
                f"identity {identity.name!r} given with role {identity.role!r} "
                f"but it already has role {known.role!r}"
            )
    return list(merged.values()) or list(DEFAULT_IDENTITIES)


def wanted_sans(
    identities: Sequence[Identity], sans: Iterable[SanRequest], *, dev: bool
) -> dict[str, tuple[x509.GeneralName, ...]]:
    """Each identity's SANs: ``DNS:<identity>``, the loopback names for the dev set, extras.

    A ``--san`` for an identity that is not being issued is refused: it would be
    silently dropped, and the operator would find out only when a peer's dial fails.
    """
    result: dict[str, list[x509.GeneralName]] = {
        i.name: [x509.DNSName(i.name), *(DEV_EXTRA_SANS if dev else ())] for i in identities
    }
    for request in sans:
        if request.identity not in result:
            raise DevCertsError(
                f"--san for {request.identity!r}, which is not issued here "
                f"(issuing {', '.join(result)}); add --identity {request.identity}:ROLE"
            )
        if request.name not in result[request.identity]:
            result[request.identity].append(request.name)
    return {name: tuple(values) for name, values in result.items()}


def cert_path(out: Path, name: str) -> Path:
    return out / f"{name}.pem"


def key_path(out: Path, name: str) -> Path:
    return out / f"{name}.key"


def _cert_bytes(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted: services load these unattended; the 0600 mode is the protection.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_pair(
    out: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, *, force: bool
) -> list[Path]:
    """Write a key (0600, it is a secret) and its certificate (0644, it is public)."""
    kpath, cpath = key_path(out, name), cert_path(out, name)
    write_file(kpath, _key_bytes(key), 0o600, force=force)
    write_file(cpath, _cert_bytes(cert), 0o644, force=force)
    return [kpath, cpath]


def load_authority(out: Path) -> Authority:
    """Read the CA from disk and check that its key and certificate belong together."""
    cpath, kpath = cert_path(out, CA_NAME), key_path(out, CA_NAME)
    try:
        cert = x509.load_pem_x509_certificate(cpath.read_bytes())
        key = serialization.load_pem_private_key(kpath.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise DevCertsError(
            f"cannot load the CA from {cpath} and {kpath}: {exc}; "
            "pass --force to replace every file"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise DevCertsError(f"{kpath} is not an EC key; pass --force to replace every file")
    if cert.public_key() != key.public_key():
        raise DevCertsError(f"{kpath} does not match {cpath}; pass --force to replace every file")
    if cert.not_valid_after_utc <= datetime.datetime.now(datetime.UTC):
        raise DevCertsError(f"the CA in {cpath} has expired; pass --force to replace every file")
    return Authority(cert=cert, key=key)


def leaf_state(out: Path, identity: Identity) -> str:
    """``complete``, ``missing`` or ``partial`` (one of certificate and key is present)."""
    present = [p.exists() for p in (cert_path(out, identity.name), key_path(out, identity.name))]
    if all(present):
        return "complete"
    return "partial" if any(present) else "missing"


def check_leaves(out: Path, identities: Sequence[Identity]) -> tuple[list[Identity], bool]:
    """The identities to issue, and whether any leaf file already exists.

    A half-present pair is refused: issuing a fresh pair would overwrite the half
    that exists, and keeping it would leave a certificate without its key.
    """
    states = {i: leaf_state(out, i) for i in identities}
    partial = [i.name for i, s in states.items() if s == "partial"]
    if partial:
        raise DevCertsError(
            f"only one of certificate and key exists for {', '.join(partial)} in {out}; "
            "pass --force to replace every file (or delete the leftover file)"
        )
    missing = [i for i, s in states.items() if s == "missing"]
    return missing, len(missing) < len(identities)


def _missing_ca_message(ca_cert: Path, ca_key: Path) -> str:
    """Say what cannot be done without the missing CA file, and the way out."""
    fix = "pass --force to regenerate the CA and every certificate"
    if not ca_key.exists() and ca_cert.exists():
        return f"the CA key {ca_key} is missing, so no certificate can be signed; {fix}"
    if not ca_cert.exists() and ca_key.exists():
        return f"the CA certificate {ca_cert} is missing, so nothing can be verified; {fix}"
    return (
        f"the CA ({ca_cert}, {ca_key}) is missing but certificates it signed exist in "
        f"{ca_cert.parent}; {fix}"
    )


def obtain_authority(out: Path, days: int, *, leaves_exist: bool) -> tuple[Authority, list[Path]]:
    """Reuse the CA on disk, or create one if nothing it should have signed exists yet.

    Returns the CA and the files written for it (none when it was reused).
    """
    ca_cert, ca_key = cert_path(out, CA_NAME), key_path(out, CA_NAME)
    if ca_cert.exists() and ca_key.exists():
        return load_authority(out), []
    if ca_key.exists() or ca_cert.exists() or leaves_exist:
        raise DevCertsError(_missing_ca_message(ca_cert, ca_key))
    key = new_key()
    authority = Authority(cert=build_ca(key, days), key=key)
    return authority, write_pair(out, CA_NAME, authority.cert, authority.key, force=False)


def leaf_mismatch(path: Path, identity: Identity, sans: Sequence[x509.GeneralName]) -> str | None:
    """Why the leaf at ``path`` is not the one asked for (role or names), or None if it is."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        found = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound) as exc:
        return f"{path} cannot be read as a certificate with SANs ({exc})"
    roles = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    if roles != [identity.role]:
        return f"{path} has role {', '.join(map(str, roles)) or 'none'}, not {identity.role}"
    if set(found) != set(sans):
        have = ", ".join(describe_san(n) for n in found)
        want = ", ".join(describe_san(n) for n in sans)
        return f"{path} names {have}, but {want} was asked"
    return None


def check_existing(
    out: Path, identities: Sequence[Identity], sans: dict[str, tuple[x509.GeneralName, ...]]
) -> None:
    """Refuse to keep a leaf whose role or names differ from the request.

    Keeping it would report success while a peer dialling the new name still fails
    its handshake; replacing it unasked would break the hosts it was copied to.
    """
    for identity in identities:
        path = cert_path(out, identity.name)
        reason = leaf_mismatch(path, identity, sans[identity.name])
        if reason is not None:
            raise DevCertsError(
                f"{reason}; pass --reissue {identity.name} to replace just that leaf "
                "(signed by the existing CA) or --force to replace every file"
            )


def generate(
    out: Path,
    identities: Sequence[Identity],
    *,
    days: int,
    force: bool,
    sans: dict[str, tuple[x509.GeneralName, ...]] | None = None,
    reissue: Iterable[str] = (),
) -> list[Path]:
    """Bring ``out`` to a complete set of certificates; return the files written.

    ``sans`` defaults to the development names (``wanted_sans(..., dev=True)``);
    ``reissue`` names leaves to replace even though they exist.
    """
    if sans is None:
        sans = wanted_sans(identities, (), dev=True)
    replace = set(reissue)
    unknown = replace - {i.name for i in identities}
    if unknown:
        raise DevCertsError(f"--reissue {', '.join(sorted(unknown))}: not an identity issued here")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if force:
        key = new_key()
        authority = Authority(cert=build_ca(key, days), key=key)
        written += write_pair(out, CA_NAME, authority.cert, authority.key, force=True)
        to_issue = list(identities)
    else:
        kept = [i for i in identities if i.name not in replace]
        missing, leaves_exist = check_leaves(out, kept)
        check_existing(out, [i for i in kept if i not in missing], sans)
        to_issue = [i for i in identities if i in missing or i.name in replace]
        ca_complete = cert_path(out, CA_NAME).exists() and key_path(out, CA_NAME).exists()
        if not to_issue and ca_complete:
            return written  # nothing is missing: keep every file as it is
        authority, written = obtain_authority(out, days, leaves_exist=leaves_exist or bool(replace))
    for identity in to_issue:
        key = new_key()
        cert = build_leaf(identity, key, authority, days, sans[identity.name])
        overwrite = force or identity.name in replace
        written += write_pair(out, identity.name, cert, key, force=overwrite)
    return written


def _display(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of days")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Generate development mTLS certificates (CN = identity, OU = role)."
    )
    parser.add_argument("--out", type=Path, default=ROOT / "certs" / "dev", help="directory")
    parser.add_argument("--force", action="store_true", help="replace every existing file")
    parser.add_argument(
        "--days", type=_positive_int, default=DEFAULT_DAYS, help="validity of new certificates"
    )
    parser.add_argument(
        "--identity",
        dest="identities",
        type=parse_identity,
        action="append",
        default=[],
        metavar="NAME:ROLE",
        help="issue this identity (repeatable); when given, only the identities named "
        "(default: the dev set edge, control-plane, node-a, node-b, worker)",
    )
    parser.add_argument(
        "--san",
        dest="sans",
        type=parse_san,
        action="append",
        default=[],
        metavar="IDENTITY=DNS:name|IDENTITY=IP:addr",
        help="one more name peers dial IDENTITY by, besides DNS:IDENTITY (repeatable)",
    )
    parser.add_argument(
        "--dev",
        action="store_true",
        help="issue the dev set besides any --identity, every leaf also valid for localhost "
        "and 127.0.0.1 (what make run and the compose stack use; implied without --identity)",
    )
    parser.add_argument(
        "--reissue",
        action="append",
        default=[],
        metavar="NAME",
        help="replace NAME's existing leaf (new key, current names), signed by the existing CA",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        dev = args.dev or not args.identities
        identities = merge_identities([*(DEFAULT_IDENTITIES if dev else ()), *args.identities])
        sans = wanted_sans(identities, args.sans, dev=dev)
        written = generate(
            args.out,
            identities,
            days=args.days,
            force=args.force,
            sans=sans,
            reissue=args.reissue,
        )
    except (DevCertsError, OSError) as exc:
        print(f"devcerts: error: {exc}", file=sys.stderr)
        return 1
    if not written:
        where = _display(args.out)
        print(f"certificates in {where} already exist; keeping them (--force replaces them)")
    for path in written:
        print(f"wrote {_display(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
