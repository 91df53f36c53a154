"""Settings of the worker, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from iop_proto.service import ServiceSettings


class WorkerSettings(ServiceSettings):
    """The worker's settings file; `IOP_*` environment variables override any key."""

    service_id: str = "worker"
