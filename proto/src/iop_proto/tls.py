"""One TLS builder per side, and the identity a peer's certificate carries.

Both sides present certificates (mTLS) and verify the other against the fleet
CA. The certificate's subject common name is the service identity (``edge``,
``node-a`` ...); its organizational unit is the role (``edge``, ``node``,
``worker``, ``control-plane``) so a server can refuse the wrong kind of peer.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from iop_proto.errors import IopError, TlsConfigError
from iop_proto.tls_reload import ReloadingContext

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


class TlsSettings(BaseModel):
    """Certificate files of one service. ``enabled: false`` is plaintext, for debugging only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _files_when_enabled(self) -> TlsSettings:
        if self.enabled:
            missing = [n for n in ("ca_file", "cert_file", "key_file") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"tls is enabled but {', '.join(missing)} not set")
        return self


def _load(context: ssl.SSLContext, settings: TlsSettings) -> ssl.SSLContext:
    # The model guarantees the three files are set when TLS is enabled.
    assert settings.ca_file is not None
    assert settings.cert_file is not None
    assert settings.key_file is not None
    context.minimum_version = MINIMUM_VERSION
    try:
        context.load_cert_chain(settings.cert_file, settings.key_file)
        context.load_verify_locations(cafile=settings.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"cannot load TLS files (cert={settings.cert_file}, key={settings.key_file}, "
            f"ca={settings.ca_file}): {exc}"
        ) from exc
    return context


def server_context(settings: TlsSettings) -> ssl.SSLContext:
    """A server context that requires and verifies a client certificate; it loads its
    files again when they change (``tls_reload``: a CA rotated without a restart)."""
    return _reloading(ssl.PROTOCOL_TLS_SERVER, settings)


def client_context(settings: TlsSettings) -> ssl.SSLContext:
    """A client context that verifies the server's certificate and host name; it loads
    its files again when they change, as ``server_context``'s."""
    return _reloading(ssl.PROTOCOL_TLS_CLIENT, settings)


def _configure(context: ssl.SSLContext, settings: TlsSettings) -> ssl.SSLContext:
    context.verify_mode = ssl.CERT_REQUIRED
    if context.protocol == ssl.PROTOCOL_TLS_CLIENT:
        context.check_hostname = True
    return _load(context, settings)


def _reloading(protocol: ssl._SSLMethod, settings: TlsSettings) -> ssl.SSLContext:
    files = tuple(p for p in (settings.ca_file, settings.cert_file, settings.key_file) if p)
    context = ReloadingContext(
        protocol, files, lambda: _configure(ssl.SSLContext(protocol), settings)
    )
    return _configure(context, settings)


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who is on the other end, as its verified certificate says."""

    name: str
    role: str | None = None


def identity_from_certificate(cert: dict[str, Any]) -> PeerIdentity | None:
    """Read CN (identity) and OU (role) from ``SSLSocket.getpeercert()`` output."""
    fields: dict[str, str] = {}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            fields.setdefault(key, value)
    name = fields.get("commonName")
    if not name:
        return None
    return PeerIdentity(name=name, role=fields.get("organizationalUnitName"))


def peer_identity(writer: asyncio.StreamWriter) -> PeerIdentity | None:
    """The verified identity of a stream's peer, or ``None`` on a plaintext stream."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    cert = ssl_object.getpeercert()
    return identity_from_certificate(cert) if cert else None


class TlsRefused(IopError):
    """A peer failed the TLS handshake; ``reason`` is a short code for logs and metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def refusal_reason(exc: BaseException) -> str:
    """A short code for a failed handshake, for logs and the refusal metrics."""
    if isinstance(exc, TimeoutError):
        return "handshake_timeout"
    if isinstance(exc, ssl.SSLCertVerificationError):
        message = (exc.verify_message or "").lower()
        return "certificate_expired" if "expired" in message else "certificate_untrusted"
    reason = getattr(exc, "reason", None) or ""
    if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL"):
        return "not_tls"
    if "CERTIFICATE" in reason and ("PEER_DID_NOT_RETURN" in reason or "NO_CERTIFICATE" in reason):
        return "no_certificate"
    if reason in ("CERTIFICATE_VERIFY_FAILED", "TLSV1_ALERT_UNKNOWN_CA"):
        return "certificate_untrusted"
    if "EXPIRED" in reason:
        return "certificate_expired"
    return "handshake_failed"
