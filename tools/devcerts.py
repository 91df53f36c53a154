"""Generate the development CA and one mTLS certificate per IOP service identity.

Every IOP service is both a TLS server and a TLS client of its neighbours, so each
leaf certificate carries serverAuth and clientAuth. A peer's identity is the
certificate's subject commonName and its role the organizationalUnitName (see
``iop_proto.tls``); the SANs cover ``localhost``, 127.0.0.1 and the docker compose
service name, which is the identity itself.

Existing files are never overwritten without ``--force``: regenerating a CA behind
the back of running services, or of certificates copied elsewhere, breaks them in
ways that are slow to diagnose. Without ``--force`` only missing leaves are issued,
signed by the CA already on disk.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DAYS = 365
CA_NAME = "ca"
CA_COMMON_NAME = "IOP development CA"
ORGANIZATION = "IOP development"
# A little backdating so a certificate made now is valid on a peer whose clock lags.
CLOCK_SKEW = datetime.timedelta(minutes=5)
# The identity is also a DNS SAN (the compose service name), so it must be a DNS label.
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_ROLE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class DevCertsError(Exception):
    """A state of the output directory that the generator refuses to resolve by itself."""


@dataclass(frozen=True, slots=True)
class Identity:
    """A service identity (certificate CN) and its role (certificate OU)."""

    name: str
    role: str


DEFAULT_IDENTITIES: tuple[Identity, ...] = (
    Identity("edge", "edge"),
    Identity("control-plane", "control-plane"),
    Identity("node-a", "node"),
    Identity("node-b", "node"),
    Identity("worker", "worker"),
)


@dataclass(frozen=True, slots=True)
class Authority:
    """The CA's certificate and private key, needed together to sign leaves."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def parse_identity(text: str) -> Identity:
    """Parse ``NAME:ROLE`` early, so a typo is a usage error rather than a bad certificate."""
    name, sep, role = text.partition(":")
    if not sep or not _DNS_LABEL.match(name) or not _ROLE.match(role):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME:ROLE (lower-case letters, digits and '-', "
            "NAME usable as a DNS label)"
        )
    if name == CA_NAME:
        raise argparse.ArgumentTypeError(f"{CA_NAME!r} is reserved for the CA's own files")
    return Identity(name, role)


def merge_identities(extra: Iterable[Identity]) -> list[Identity]:
    """The default identities plus extras; one name with two roles is a mistake, not a merge."""
    merged: dict[str, Identity] = {i.name: i for i in DEFAULT_IDENTITIES}
    for identity in extra:
        known = merged.setdefault(identity.name, identity)
        if known.role != identity.role:
            raise DevCertsError(
                f"identity {identity.name!r} given with role {identity.role!r} "
                f"but it already has role {known.role!r}"
            )
    return list(merged.values())


def cert_path(out: Path, name: str) -> Path:
    return out / f"{name}.pem"


def key_path(out: Path, name: str) -> Path:
    return out / f"{name}.key"


def new_key() -> ec.EllipticCurvePrivateKey:
    """P-256: fast to generate and accepted by every TLS stack we talk to."""
    return ec.generate_private_key(ec.SECP256R1())


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - CLOCK_SKEW, now + datetime.timedelta(days=days)


def build_ca(key: ec.EllipticCurvePrivateKey, days: int) -> x509.Certificate:
    """A self-signed CA that may sign leaves only (path length 0)."""
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME),
        ]
    )
    not_before, not_after = _validity(days)
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


def build_leaf(
    identity: Identity, key: ec.EllipticCurvePrivateKey, ca: Authority, days: int
) -> x509.Certificate:
    """A certificate usable on both ends of mTLS, naming the identity (CN) and role (OU)."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
            x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
        ]
    )
    sans = x509.SubjectAlternativeName(
        [
            x509.DNSName("localhost"),
            x509.DNSName(identity.name),
            x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
        ]
    )
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    not_before, not_after = _validity(days)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(min(not_after, ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(sans, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )


def _cert_bytes(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted: services load these unattended; the 0600 mode is the protection.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_file(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    """Write ``data`` with ``mode``; replace an existing file only when ``force``.

    Without ``force`` the file is created exclusively, so even a file that appeared
    since we looked is not clobbered. With ``force`` a temporary file is renamed
    over the old one, so a reader never sees a half-written key.
    """
    if not force:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)  # the umask may have narrowed or widened it
            handle.write(data)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def generate(out: Path, identities: Sequence[Identity], *, days: int, force: bool) -> list[Path]:
    """Bring ``out`` to a complete set of dev certificates; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if force:
        key = new_key()
        authority = Authority(cert=build_ca(key, days), key=key)
        written += write_pair(out, CA_NAME, authority.cert, authority.key, force=True)
        to_issue = list(identities)
    else:
        to_issue, leaves_exist = check_leaves(out, identities)
        ca_complete = cert_path(out, CA_NAME).exists() and key_path(out, CA_NAME).exists()
        if not to_issue and ca_complete:
            return written  # nothing is missing: keep every file as it is
        authority, written = obtain_authority(out, days, leaves_exist=leaves_exist)
    for identity in to_issue:
        key = new_key()
        cert = build_leaf(identity, key, authority, days)
        written += write_pair(out, identity.name, cert, key, force=force)
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
        help="an identity to add to the default set (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        identities = merge_identities(args.identities)
        written = generate(args.out, identities, days=args.days, force=args.force)
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
