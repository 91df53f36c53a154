"""The X.509 half of tools/devcerts.py: identities, names, and the CA and leaf certificates.

Kept apart from the file handling so each module has one job; devcerts.py imports it
from its own directory (it runs as a script, here and in the iop-init image).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 365
CA_NAME = "ca"
CA_COMMON_NAME = "IOP development CA"
ORGANIZATION = "IOP development"
# A little backdating so a certificate made now is valid on a peer whose clock lags.
CLOCK_SKEW = datetime.timedelta(minutes=5)
# The identity is also a DNS SAN (the compose service name), so it must be a DNS label.
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_ROLE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


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


DEV_EXTRA_SANS: tuple[x509.GeneralName, ...] = (
    x509.DNSName("localhost"),
    x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
)


@dataclass(frozen=True, slots=True)
class SanRequest:
    """``--san IDENTITY=DNS:name`` or ``IDENTITY=IP:addr``: one more name on one leaf."""

    identity: str
    name: x509.GeneralName


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


def parse_san(text: str) -> SanRequest:
    """Parse ``IDENTITY=DNS:name`` / ``IDENTITY=IP:addr``; a bad address is a usage error."""
    identity, sep, value = text.partition("=")
    kind, colon, name = value.partition(":")
    usage = f"{text!r} is not IDENTITY=DNS:name or IDENTITY=IP:address"
    if not sep or not colon or not name or not _DNS_LABEL.match(identity):
        raise argparse.ArgumentTypeError(usage)
    if kind.upper() == "DNS":
        if not all(_DNS_LABEL.match(label) for label in name.lower().split(".")):
            raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is not a DNS name")
        return SanRequest(identity, x509.DNSName(name.lower()))
    if kind.upper() == "IP":
        try:
            return SanRequest(identity, x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is not an IP address") from None
    raise argparse.ArgumentTypeError(usage)


def describe_san(name: x509.GeneralName) -> str:
    """``DNS:edge`` / ``IP:10.0.0.1``, the way ``--san`` and openssl write them."""
    if isinstance(name, x509.IPAddress):
        return f"IP:{name.value}"
    return f"DNS:{name.value}"


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
    identity: Identity,
    key: ec.EllipticCurvePrivateKey,
    ca: Authority,
    days: int,
    sans: Sequence[x509.GeneralName],
) -> x509.Certificate:
    """A certificate usable on both ends of mTLS, naming the identity (CN) and role (OU)."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
            x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
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
        .add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )
