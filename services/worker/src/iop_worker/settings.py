"""Settings of the worker, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from iop_proto.edges import seed_edges
from iop_proto.service import DrainingSettings
from iop_proto.service.settings import FrozenModel


class EdgeAddress(FrozenModel):
    """The edge this worker dials: its node listener (IOP over mTLS)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=7000, ge=1, le=65535)
    server_name: str | None = Field(
        default=None, description="name the edge's certificate must carry; default: host"
    )


class ReconnectSettings(FrozenModel):
    """Jittered exponential backoff after any loss of the edge connection."""

    initial_s: float = Field(default=0.5, gt=0)
    max_s: float = Field(default=15.0, gt=0)

    @model_validator(mode="after")
    def _max_not_below_initial(self) -> ReconnectSettings:
        if self.max_s < self.initial_s:
            raise ValueError(f"max_s ({self.max_s}) is below initial_s ({self.initial_s})")
        return self


class WorkerSettings(DrainingSettings):
    """The worker's settings file; `IOP_*` environment variables override any key.

    ``service_id`` is the worker id the edge leases to: it must equal the CN of
    the worker's certificate, whose role (OU ``worker``) is the credential, so
    no token is needed.
    """

    service_id: str = "worker"
    edge: EdgeAddress = EdgeAddress()
    edges: tuple[EdgeAddress, ...] = Field(
        default=(),
        description="more edges to dial from the start, besides edge (or instead of it, "
        "when edge is not set); the others are learnt from the edges (follow_edges)",
    )
    follow_edges: bool = Field(
        default=True,
        description="dial every edge the control-plane lists too and lease from each "
        "(docs/ARCHITECTURE.md#several-edges); false: only edge and edges",
    )
    concurrency: int = Field(default=4, ge=1, description="lines of one batch in flight at once")
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="wait before asking again when there is nothing to lease"
    )
    lease_renew_interval_s: float = Field(default=10.0, gt=0)
    request_timeout_s: float = Field(
        default=900.0, gt=0, description="how long one line may take to be answered"
    )
    answer_timeout_s: float = Field(
        default=10.0, gt=0, description="how long register, lease and renew answers may take"
    )
    reconnect: ReconnectSettings = ReconnectSettings()

    @property
    def seeds(self) -> tuple[EdgeAddress, ...]:
        """The edges dialled from the start: ``edge`` (unless only ``edges`` is set) and
        ``edges``, each address once."""
        return seed_edges(self.edge, self.edges, "edge" in self.model_fields_set)
