"""Settings of the node, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from iop_proto.service import ServiceSettings


class NodeSettings(ServiceSettings):
    """The node's settings file; `IOP_*` environment variables override any key."""

    service_id: str = "node"
