"""The certificate expiry gauge: dates read from the DER agree with ``cryptography``'s, for
a throwaway CA's leaf, its CA, a bundle of two CAs (a rotation) and a 1990s UTCTime."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry, generate_latest

from iop_proto.service.cert_metrics import register_certificate_metrics
from iop_proto.tls import TlsSettings
from iop_proto.x509_dates import CertificateFormatError, read_pem


def _expected(pem: bytes) -> list[tuple[str, str, float]]:
    out = []
    for cert in x509.load_pem_x509_certificates(pem):
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        cn = str(names[0].value) if names else ""
        out.append((cn, f"{cert.serial_number:x}", cert.not_valid_after_utc.timestamp()))
    return out


def _self_signed(cn: str, not_after: datetime.datetime) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(1990, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(Encoding.PEM)


def test_dates_match_cryptography(tmp_path: Path) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("node-a")
    chain = b"".join(blob.bytes() for blob in leaf.cert_chain_pems)
    old = _self_signed("old CA", datetime.datetime(1999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))
    far = _self_signed("far CA", datetime.datetime(2077, 6, 1, 12, 0, 0, tzinfo=datetime.UTC))
    for pem in (ca.cert_pem.bytes(), chain, old + far):
        got = [(c.subject, c.serial, c.not_after) for c in read_pem(pem)]
        assert got == _expected(pem)
    assert (
        read_pem(old)[0].not_after
        == datetime.datetime(1999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC).timestamp()
    )  # UTCTime "99..." is 1999, not 2099


def test_garbage_is_a_format_error() -> None:
    with pytest.raises(CertificateFormatError):
        read_pem(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")


def test_gauge_shows_identity_and_every_ca(tmp_path: Path) -> None:
    ca, rotated = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("edge")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "edge.pem"))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes() + rotated.cert_pem.bytes())
    tls = TlsSettings(
        ca_file=tmp_path / "ca.pem", cert_file=tmp_path / "edge.pem", key_file=tmp_path / "edge.pem"
    )
    registry = CollectorRegistry()
    register_certificate_metrics(registry, "edge", tls)
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("iop_certificate_expiry")]
    roles = sorted(line.split('cert="')[1].split('"')[0] for line in lines)
    assert roles == ["ca", "ca", "identity"], text
    identity = next(line for line in lines if 'cert="identity"' in line)
    leaf_cert = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes())
    assert float(identity.rsplit(" ", 1)[1]) == leaf_cert.not_valid_after_utc.timestamp()
    assert 'service="edge"' in identity
    # the file gone: no series for it, and the scrape still answers
    (tmp_path / "ca.pem").unlink()
    text = generate_latest(registry).decode()
    assert 'cert="ca"' not in text
    assert 'cert="identity"' in text
