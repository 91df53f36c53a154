"""Settings of the control-plane, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.postgres import PostgresSettings
from iop_proto.service import ServiceSettings
from iop_proto.service.settings import FrozenModel


class ListenSettings(FrozenModel):
    """Where edges dial in (IOP over mTLS)."""

    host: str = "127.0.0.1"
    port: int = Field(default=7100, ge=0, le=65535, description="0 picks a free port")


class ControlPlaneSettings(ServiceSettings):
    """The control-plane's settings file; `IOP_*` environment variables override any key."""

    service_id: str = "control-plane"
    fleet_file: Path = Field(description="the fleet configuration: models[] and nodes[]")
    database: Path = Field(
        default=Path("var/control-plane/credentials.db"),
        description="SQLite file of node tokens and API keys (hashed)",
    )
    postgres: PostgresSettings | None = Field(
        default=None,
        description="the store every control-plane of a fleet shares (tokens, keys, "
        "retirements, node states); unset: the SQLite `database` beside this one",
    )
    pid_file: Path | None = Field(
        default=None,
        description="where the running server writes its pid for `config reload`; "
        "default: next to the database",
    )
    listen: ListenSettings = ListenSettings()
    edge_roles: tuple[str, ...] = Field(
        default=("edge",), description="certificate roles (OU) allowed to connect"
    )
    heartbeat_interval_s: float = Field(default=30.0, gt=0)
    credentials_poll_s: float = Field(
        default=0.25,
        gt=0,
        description=(
            "how often to notice token/key changes made by the CLI (one cheap PRAGMA, or"
            " one read of PostgreSQL's version row, each);"
            " a revoked key's requests end at the edge within this plus the push, under 1 s"
        ),
    )
    max_frame_size: int = Field(default=DEFAULT_MAX_FRAME_SIZE, ge=1024)

    @property
    def resolved_pid_file(self) -> Path:
        return self.pid_file or self.database.with_name("control-plane.pid")
