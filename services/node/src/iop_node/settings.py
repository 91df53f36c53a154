"""Settings of the node, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from iop_node.domain.cache_account import DEFAULT_CACHE_PREFIXES
from iop_proto.edges import seed_edges
from iop_proto.errors import SettingsError
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.service import DrainingSettings
from iop_proto.service.settings import FrozenModel
from iop_proto.tracing import TracingSettings


class EdgeAddress(FrozenModel):
    """The edge this node dials (IOP over mTLS)."""

    host: str = "127.0.0.1"
    port: int = Field(default=7000, ge=1, le=65535)
    server_name: str | None = Field(
        default=None, description="name the edge's certificate must carry; default: host"
    )


class ProbeSettingsModel(FrozenModel):
    """Provider probes: cheap, periodic, with hysteresis (see domain/health.py)."""

    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    rise: int = Field(default=1, ge=1, description="successes in a row to become available")
    fall: int = Field(default=2, ge=1, description="failures in a row to become unavailable")


class ReconnectSettings(FrozenModel):
    initial_s: float = Field(default=0.5, gt=0)
    max_s: float = Field(default=15.0, gt=0)


class NodeSettings(DrainingSettings):
    """The node's settings file; `IOP_*` environment variables override any key.

    ``service_id`` is the node id: it must equal the CN of the node's certificate
    and have a token issued by the control-plane.
    """

    service_id: str = "node"
    edge: EdgeAddress = EdgeAddress()
    edges: tuple[EdgeAddress, ...] = Field(
        default=(),
        description="more edges to dial from the start, besides edge (or instead of it, "
        "when edge is not set); the others are learnt from the edges (follow_edges)",
    )
    follow_edges: bool = Field(
        default=True,
        description="dial every edge the control-plane lists too (docs/ARCHITECTURE.md"
        "#several-edges); false: only edge and edges",
    )
    token_file: Path | None = Field(default=None, description="file holding the node token")
    token: SecretStr | None = Field(default=None, description="the node token (prefer token_file)")
    history_db: Path = Field(default=Path("var/node/history.db"), description="run history")
    probes: ProbeSettingsModel = ProbeSettingsModel()
    reconnect: ReconnectSettings = ReconnectSettings()
    register_timeout_s: float = Field(default=10.0, gt=0)
    snapshot_interval_s: float = Field(
        default=10.0, gt=0, description="a snapshot is also sent on every change"
    )
    max_frame_size: int = Field(default=DEFAULT_MAX_FRAME_SIZE, ge=1024)
    tracing: TracingSettings = Field(
        default=TracingSettings(),
        description="spans of the runs the edge traced (docs/ARCHITECTURE.md#traces); off",
    )
    cache_prefixes: int = Field(
        default=DEFAULT_CACHE_PREFIXES,
        ge=0,
        le=1024,
        description="prompts a provider's snapshot names as cached, most recent first "
        "(docs/ARCHITECTURE.md#what-the-node-reports); 0 names none",
    )

    @model_validator(mode="after")
    def _one_token_source(self) -> NodeSettings:
        if self.token_file is None and self.token is None:
            raise ValueError("set token_file (or token): the node registers with a token")
        return self

    @property
    def seeds(self) -> tuple[EdgeAddress, ...]:
        """The edges dialled from the start: ``edge`` (unless only ``edges`` is set) and
        ``edges``, each address once."""
        return seed_edges(self.edge, self.edges, "edge" in self.model_fields_set)

    def read_token(self) -> str:
        """The token, read at start so a missing file fails the start, not a registration."""
        if self.token is not None:
            return self.token.get_secret_value().strip()
        assert self.token_file is not None
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise SettingsError(
                f"token_file {self.token_file} cannot be read ({exc.strerror or exc}): write "
                "the node's token there (`iop-control-plane token issue --node "
                f"{self.service_id} --output FILE`)"
            ) from None
        if not token:
            raise SettingsError(f"token_file {self.token_file} is empty")
        return token
