"""What the edge keeps, for ``iop-edge backup`` / ``restore`` (iop_proto.backup).

On SQLite: the run log, the stored responses, the batch store with its file
contents, and the qualification reports. On PostgreSQL: the shared store every edge of
the fleet uses (one dump).
Not here: the fleet config cache (fetched again from the control-plane at start) and
the reasoning key file (a secret of the settings, kept with them).
"""

from __future__ import annotations

from iop_edge import __version__
from iop_edge.adapters import (
    batch_schema,
    pg_batch_schema,
    pg_key_rates,
    pg_key_slots,
    pg_qualifications,
    postgres_responses,
    postgres_runlog,
    response_rows,
    sqlite_qualifications,
    sqlite_runlog,
)
from iop_edge.adapters.batch_files import ContentDir
from iop_edge.settings import EdgeSettings
from iop_proto.backup.archive import ServiceState, StateFile


def edge_state(settings: EdgeSettings) -> ServiceState:
    if settings.postgres is not None:
        versions = {
            postgres_runlog.COMPONENT: len(postgres_runlog.STEPS),
            postgres_responses.COMPONENT: len(postgres_responses.STEPS),
            pg_batch_schema.COMPONENT: len(pg_batch_schema.STEPS),
            pg_key_rates.COMPONENT: len(pg_key_rates.STEPS),
            pg_key_slots.COMPONENT: len(pg_key_slots.STEPS),
            pg_qualifications.COMPONENT: len(pg_qualifications.STEPS),
        }
        return ServiceState(
            "edge",
            __version__,
            postgres_dsn=settings.postgres.dsn.get_secret_value(),
            postgres_versions=versions,
        )
    return ServiceState(
        "edge",
        __version__,
        files=(
            StateFile("runs.db", settings.history_db, sqlite_runlog.SCHEMA_VERSION),
            StateFile("responses.db", settings.responses_db, response_rows.SCHEMA_VERSION),
            StateFile(
                "batches.db",
                settings.batch_db,
                batch_schema.SCHEMA_VERSION,
                contents=ContentDir.beside(settings.batch_db).path,
            ),
            StateFile(
                "qualifications.db",
                settings.qualifications_path,
                sqlite_qualifications.SCHEMA_VERSION,
            ),
        ),
    )
