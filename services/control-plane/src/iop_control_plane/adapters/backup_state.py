"""What the control-plane keeps, for ``iop-control-plane backup`` / ``restore``
(iop_proto.backup): its credentials database (node tokens, API keys and their
policies, retirements, node states), or the PostgreSQL store it shares with the
fleet. The fleet file is configuration, kept with the settings."""

from __future__ import annotations

from iop_control_plane import __version__
from iop_control_plane.adapters import postgres_store
from iop_control_plane.adapters.sqlite_store import SCHEMA_VERSION
from iop_control_plane.settings import ControlPlaneSettings
from iop_proto.backup.archive import ServiceState, StateFile


def control_plane_state(settings: ControlPlaneSettings) -> ServiceState:
    if settings.postgres is not None:
        return ServiceState(
            "control-plane",
            __version__,
            postgres_dsn=settings.postgres.dsn.get_secret_value(),
            postgres_versions={postgres_store.COMPONENT: len(postgres_store.STEPS)},
        )
    return ServiceState(
        "control-plane",
        __version__,
        files=(StateFile("credentials.db", settings.database, SCHEMA_VERSION),),
    )
