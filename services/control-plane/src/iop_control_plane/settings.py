"""Settings of the control-plane, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from iop_proto.service import ServiceSettings


class ControlPlaneSettings(ServiceSettings):
    """The control-plane's settings file; `IOP_*` environment variables override any key."""

    service_id: str = "control-plane"
