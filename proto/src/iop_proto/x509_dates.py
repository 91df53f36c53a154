"""The expiry of PEM certificates, read with no X.509 library.

The services' runtime has no ``cryptography`` (the edge alone needs it, for AES-GCM), and
``ssl`` shows the fields of CA certificates only (``SSLContext.get_ca_certs``), never of a
service's own leaf. What an expiry metric needs is three fields at fixed places of the
DER encoding (RFC 5280, 4.1): ``tbsCertificate`` is a SEQUENCE of an optional ``[0]``
version, the serial number, the signature algorithm, the issuer, the validity (two times)
and the subject; so a walk of a few tag-length-value headers reaches them.
"""

from __future__ import annotations

import base64
import calendar
import re
from dataclasses import dataclass

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _SET, _INTEGER, _OID, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0x31, 0x02, 0x06, 0x17, 0x18
_VERSION = 0xA0  # [0] EXPLICIT, absent in v1 certificates
_COMMON_NAME = b"\x55\x04\x03"  # 2.5.4.3


class CertificateFormatError(ValueError):
    """The bytes are not the DER of an X.509 certificate this module can read."""


@dataclass(frozen=True, slots=True)
class CertificateDates:
    """What an expiry metric shows of one certificate."""

    subject: str  # the subject's common name ("" when it has none)
    serial: str  # the serial number, lower-case hex
    not_after: float  # seconds since the epoch (UTC)


def read_pem(data: bytes) -> list[CertificateDates]:
    """Every certificate of a PEM file (a CA bundle holds several during a rotation)."""
    return [read_der(base64.b64decode(block)) for block in _PEM.findall(data)]


def read_der(der: bytes) -> CertificateDates:
    try:
        _, start, _ = _header(der, 0, _SEQUENCE)  # Certificate
        _, pos, _ = _header(der, start, _SEQUENCE)  # tbsCertificate
        if der[pos] == _VERSION:
            pos = _header(der, pos)[2]
        _, serial_start, pos = _header(der, pos, _INTEGER)
        serial = der[serial_start:pos].hex().lstrip("0") or "0"
        pos = _header(der, pos, _SEQUENCE)[2]  # signature algorithm
        pos = _header(der, pos, _SEQUENCE)[2]  # issuer
        _, validity, pos = _header(der, pos, _SEQUENCE)
        not_after_pos = _header(der, validity)[2]  # past notBefore
        not_after = _time(der, not_after_pos)
        _, subject_start, subject_end = _header(der, pos, _SEQUENCE)
        subject = _common_name(der, subject_start, subject_end)
    except (IndexError, ValueError) as exc:
        raise CertificateFormatError(f"not a readable X.509 certificate: {exc}") from exc
    return CertificateDates(subject=subject, serial=serial, not_after=not_after)


def _header(der: bytes, pos: int, expected: int | None = None) -> tuple[int, int, int]:
    """The tag at ``pos``, where its content starts and where it ends (DER: definite lengths)."""
    tag = der[pos]
    if expected is not None and tag != expected:
        raise ValueError(f"tag {tag:#x} at {pos}, expected {expected:#x}")
    length = der[pos + 1]
    pos += 2
    if length & 0x80:
        size = length & 0x7F
        length = int.from_bytes(der[pos : pos + size], "big")
        pos += size
    end = pos + length
    if end > len(der):
        raise ValueError(f"length {length} at {pos} runs past the end")
    return tag, pos, end


def _time(der: bytes, pos: int) -> float:
    tag, start, end = _header(der, pos)
    text = der[start:end].decode("ascii").removesuffix("Z")
    if tag == _UTC_TIME:  # YYMMDDHHMMSS: 50-99 are 19xx (RFC 5280, 4.1.2.5.1)
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"tag {tag:#x} is not a time")
    fields = (text[0:4], text[4:6], text[6:8], text[8:10], text[10:12], text[12:14])
    return float(calendar.timegm(tuple(int(field) for field in fields)))


def _common_name(der: bytes, pos: int, end: int) -> str:
    """The first CN of a Name: a SEQUENCE of SETs of (OID, value) SEQUENCEs."""
    while pos < end:
        _, item, pos = _header(der, pos, _SET)
        _, attribute, _ = _header(der, item, _SEQUENCE)
        _, oid_start, oid_end = _header(der, attribute, _OID)
        if der[oid_start:oid_end] == _COMMON_NAME:
            _, value_start, value_end = _header(der, oid_end)
            return der[value_start:value_end].decode("utf-8", "replace")
    return ""
