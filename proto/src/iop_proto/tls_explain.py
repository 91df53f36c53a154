"""Why a TLS handshake failed, in words that name the setting which fixes it.

Each side of a failed mTLS handshake sees something different. The side that rejected
the other's certificate has the verification error (a name the certificate lacks, an
unknown CA, an expiry): it says what did not match and which setting or command fixes
it. The other side sees only the connection close (TLS 1.3: a client whose certificate
the server rejected even sees its handshake succeed, then end-of-file): it says that
the peer closed, and that the peer's log has the reason; it never claims a refusal of
its own.

Which failures are configuration errors (``TlsMismatch``: the process stops, exit
code 2) and which are transient (retried with backoff) is decided where the
certificate was checked: only the rejecting side knows for sure that a certificate
does not fit, and nothing but an operator changes certificates or settings, so
retrying such a handshake only fills the log. A peer closing during or right after
the handshake is left transient: an edge restarting or a network reset looks the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from typing import Any

from iop_proto.errors import ConfigurationError
from iop_proto.tls import TlsSettings, client_context

# OpenSSL's X509_V_ERR_* codes (``SSLCertVerificationError.verify_code``)
_UNTRUSTED = {2, 18, 19, 20, 21}  # no issuer here, self-signed, unable to get local issuer
_NOT_YET_VALID, _EXPIRED = 9, 10
_NAME_MISMATCH = {62, 64}  # hostname, IP address

PEER_CLOSED_REASON = "peer_closed"
"""The reason code (logs, refusal metrics) of a handshake the peer ended."""
PEER_CLOSED = (
    "the peer closed during the TLS handshake (it rejected our certificate or we rejected "
    "its: a name or address it dialled that our certificate does not carry, or a CA it "
    "does not trust; its own log says which)"
)


class TlsMismatch(ConfigurationError):
    """A peer's certificate does not fit our TLS settings; retrying cannot change that."""


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address (its SAN is IP:, not DNS:)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def certificate_names(cert: dict[str, Any]) -> list[str]:
    """``DNS:edge``, ``IP:10.0.0.1`` ... from ``getpeercert()``'s subjectAltName."""
    kinds = {"DNS": "DNS", "IP Address": "IP"}
    return [f"{kinds.get(kind, kind)}:{value}" for kind, value in cert.get("subjectAltName", ())]


def _common_name(cert: dict[str, Any]) -> str:
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def explain_client_rejection(
    exc: ssl.SSLCertVerificationError,
    *,
    peer: str,
    dialled: str,
    setting: str,
    ca_file: object,
    peer_cert: dict[str, Any] | None = None,
) -> str:
    """What we (the dialling side) found wrong with ``peer``'s certificate.

    ``setting``: our settings section naming the peer (``edge``, ``control_plane``);
    ``peer_cert``: the certificate as a second, name-blind handshake read it (for a
    name mismatch: which names it does carry).
    """
    code = exc.verify_code
    if code in _NAME_MISMATCH:
        kind = "IP" if is_address(dialled) else "DNS"
        if peer_cert is None:
            names, identity = "other names", peer
        else:
            names = ", ".join(certificate_names(peer_cert)) or "no names"
            identity = _common_name(peer_cert) or peer
        return (
            f"the {peer}'s certificate is not valid for {dialled}: it names {names}; "
            f"set {setting}.server_name to one of those, or reissue it with "
            f"devcerts --san {identity}={kind}:{dialled}"
        )
    if code in _UNTRUSTED:
        return (
            f"the {peer}'s certificate is not signed by the CA in our tls.ca_file ({ca_file}): "
            f"set tls.ca_file to the fleet's ca.pem (the CA that signed the {peer}'s "
            "certificate), or give the peer a certificate from this CA"
        )
    if code == _EXPIRED:
        return (
            f"the {peer}'s certificate has expired: reissue it on its host "
            f"(devcerts --reissue NAME) and restart the {peer}"
        )
    if code == _NOT_YET_VALID:
        return f"the {peer}'s certificate is not valid yet: check the clocks of both hosts"
    return f"the {peer}'s certificate was rejected: {exc.verify_message or exc}"


def explain_server_rejection(exc: ssl.SSLCertVerificationError) -> str:
    """What we (the listening side) found wrong with a connecting peer's certificate."""
    code = exc.verify_code
    if code in _UNTRUSTED:
        return (
            "its certificate is not signed by the CA in our tls.ca_file: issue it from the "
            "fleet's CA (devcerts --out PKI_DIR --identity NAME:ROLE), or set our tls.ca_file "
            "to the CA that signed it"
        )
    if code == _EXPIRED:
        return "its certificate has expired: reissue it (devcerts --reissue NAME) and restart it"
    if code == _NOT_YET_VALID:
        return "its certificate is not valid yet: check the clocks of both hosts"
    return f"its certificate was rejected: {exc.verify_message or exc}"


def peer_closed_during_handshake(exc: BaseException) -> bool:
    """The handshake ended because the peer closed, without a verdict of ours."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False
    if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError | ConnectionResetError):
        return True
    if isinstance(exc, asyncio.IncompleteReadError | BrokenPipeError):
        return True
    return isinstance(exc, ssl.SSLError) and "EOF" in str(exc)


async def read_peer_certificate(
    host: str, port: int, settings: TlsSettings, server_hostname: str, timeout_s: float
) -> dict[str, Any] | None:
    """The peer's certificate, verified against our CA but not against a name: one more
    handshake, only to say which names the certificate does carry. ``None`` if it fails."""
    context = client_context(settings)
    context.check_hostname = False
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=server_hostname
            )
    except (OSError, TimeoutError, ConfigurationError):
        return None
    ssl_object = writer.get_extra_info("ssl_object")
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(timeout_s):
            await writer.wait_closed()
    return cert or None


async def rejection(
    exc: ssl.SSLCertVerificationError,
    *,
    host: str,
    port: int,
    server_name: str,
    settings: TlsSettings | None,
    peer: str,
    setting: str,
    timeout_s: float,
) -> TlsMismatch:
    """The ``TlsMismatch`` for a dial to ``peer`` whose certificate we rejected; for a
    name mismatch, after reading which names the certificate carries."""
    peer_cert = None
    if exc.verify_code in _NAME_MISMATCH and settings is not None:
        peer_cert = await read_peer_certificate(host, port, settings, server_name, timeout_s)
    ca_file = settings.ca_file if settings is not None else "?"
    return TlsMismatch(
        explain_client_rejection(
            exc,
            peer=peer,
            dialled=server_name,
            setting=setting,
            ca_file=ca_file,
            peer_cert=peer_cert,
        )
    )
