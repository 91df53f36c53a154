"""The control-plane's Prometheus metrics, registered in the registry the runner owns."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(frozen=True, slots=True)
class ControlPlaneMetrics:
    edges_connected: Gauge
    config_version: Gauge
    authorizations: Counter
    reloads: Counter
    pushes: Counter
    tls_refusals: Counter
    credential_expiry: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ControlPlaneMetrics:
        return cls(
            edges_connected=Gauge(
                "iop_control_plane_edges_connected",
                "Edges connected over IOP right now",
                registry=registry,
            ),
            config_version=Gauge(
                "iop_control_plane_config_version",
                "Version of the fleet configuration being served",
                registry=registry,
            ),
            authorizations=Counter(
                "iop_control_plane_authorizations",
                "Node registrations decided, by result and refusal reason",
                ["result", "reason"],
                registry=registry,
            ),
            reloads=Counter(
                "iop_control_plane_config_reloads",
                "Fleet file reloads, by result (applied, unchanged, refused)",
                ["result"],
                registry=registry,
            ),
            pushes=Counter(
                "iop_control_plane_config_pushes",
                "Fleet configurations sent to edges",
                registry=registry,
            ),
            tls_refusals=Counter(
                "iop_control_plane_tls_refusals",
                "Connections refused in the TLS handshake, by reason",
                ["reason"],
                registry=registry,
            ),
            credential_expiry=Gauge(
                "iop_credential_expiry_timestamp_seconds",
                "When an API key (kind api_key) or node token (kind node_token) that is not"
                " revoked stops being accepted, unix seconds; none for one that never expires",
                ["kind", "id"],
                registry=registry,
            ),
        )
