"""The credential store, opened where the settings say: one SQLite file beside this
control-plane (the default), or the PostgreSQL store every control-plane of a fleet
shares (``postgres:``, docs/ARCHITECTURE.md "The control-plane on PostgreSQL").

One function, used by the server and by the CLI alike, so both always open the same
store from the same settings file.
"""

from __future__ import annotations

from iop_control_plane.adapters.postgres_store import PostgresCredentialStore
from iop_control_plane.adapters.sqlite_store import SqliteCredentialStore
from iop_control_plane.ports import OpenedCredentialStore
from iop_control_plane.settings import ControlPlaneSettings


async def open_store(settings: ControlPlaneSettings) -> OpenedCredentialStore:
    """Open the configured store; the caller must ``aclose()`` it.

    On PostgreSQL, ``StorageUnavailable`` when the server cannot be reached now.
    """
    if settings.postgres is None:
        return await SqliteCredentialStore.open(settings.database)
    return await PostgresCredentialStore.open(settings.postgres)
