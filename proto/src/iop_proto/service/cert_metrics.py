"""``iop_certificate_expiry_timestamp_seconds``: when each certificate a service holds expires.

Every service exposes its own: the identity it presents (``cert="identity"``, the first
block of ``tls.cert_file``; a chain after it is ``cert="chain"``) and each CA it trusts
(``cert="ca"``, every block of ``tls.ca_file``: two while a CA is rotated). The files are
read at each scrape, so a certificate replaced on disk shows at the next one, and nothing
runs in between; a file that cannot be read shows no series (and is logged), which the
``IopCertificateMetricMissing`` alert of deploy/prometheus/alerts.yml catches.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from loguru import logger
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from iop_proto.tls import TlsSettings
from iop_proto.x509_dates import CertificateFormatError, read_pem

METRIC = "iop_certificate_expiry_timestamp_seconds"


class CertificateCollector(Collector):
    """The expiry of the certificates in a service's TLS settings, read when scraped."""

    def __init__(self, service: str, tls: TlsSettings) -> None:
        self._service = service
        files: list[tuple[str, Path]] = []
        if tls.enabled and tls.cert_file is not None and tls.ca_file is not None:
            files = [("identity", tls.cert_file), ("ca", tls.ca_file)]
        self._files = files

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = self._family()
        for role, path in self._files:
            try:
                certificates = read_pem(path.read_bytes())
            except (OSError, CertificateFormatError) as exc:
                logger.warning("certificate expiry of {} unknown: {}", path, exc)
                continue
            for index, certificate in enumerate(certificates):
                cert = "chain" if role == "identity" and index else role
                labels = (self._service, cert, certificate.subject, certificate.serial)
                family.add_metric(labels, certificate.not_after)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            METRIC,
            "When a certificate of this service expires (notAfter, seconds since the epoch),"
            " by role: identity (the one it presents), chain, ca (each CA it trusts)",
            labels=["service", "cert", "subject", "serial"],
        )


def register_certificate_metrics(
    registry: CollectorRegistry, service: str, tls: TlsSettings
) -> None:
    """Add the expiry gauge of ``tls``'s certificates to a service's registry."""
    registry.register(CertificateCollector(service, tls))
