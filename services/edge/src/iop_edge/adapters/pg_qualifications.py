"""Qualification reports in the PostgreSQL store every edge of a fleet shares
(``QualificationStore``): a report stored through one edge is listed by all."""

from __future__ import annotations

from typing import Final, Self

import asyncpg

from iop_edge.adapters.sqlite_qualifications import stored
from iop_edge.qualification_ports import MAX_LISTED, StoredReport
from iop_proto import json_codec
from iop_proto.postgres import apply_migrations, reachable

COMPONENT: Final = "edge_qualifications"
STEPS: Final = (
    """
    CREATE TABLE iop_qualifications (
        report_id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        provider_id TEXT NOT NULL,
        node_id TEXT NOT NULL,
        created_ms BIGINT NOT NULL,
        report TEXT NOT NULL
    );
    CREATE INDEX iop_qualifications_model ON iop_qualifications (model, created_ms);
    CREATE INDEX iop_qualifications_created ON iop_qualifications (created_ms);
    """,
)
_COLUMNS: Final = "report_id, model, provider_id, node_id, created_ms, report"


class PostgresQualifications:
    """``QualificationStore`` over the shared pool (which the edge's stores own)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, pool: asyncpg.Pool) -> Self:
        await apply_migrations(pool, COMPONENT, STEPS)
        return cls(pool)

    async def aclose(self) -> None:
        """Nothing of its own to close: the pool is the stores'."""

    async def add(self, report: StoredReport) -> None:
        with reachable("storing a qualification report"):
            await self._pool.execute(
                f"INSERT INTO iop_qualifications ({_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)",
                report.report_id,
                report.model,
                report.provider_id,
                report.node_id,
                report.created_ms,
                json_codec.dumps(report.report).decode(),
            )

    async def get(self, report_id: str) -> StoredReport | None:
        with reachable("reading a qualification report"):
            row = await self._pool.fetchrow(
                f"SELECT {_COLUMNS} FROM iop_qualifications WHERE report_id = $1", report_id
            )
        return None if row is None else stored(tuple(row))

    async def recent(self, model: str | None = None) -> list[StoredReport]:
        with reachable("listing qualification reports"):
            if model is None:
                rows = await self._pool.fetch(
                    f"SELECT {_COLUMNS} FROM iop_qualifications ORDER BY created_ms DESC LIMIT $1",
                    MAX_LISTED,
                )
            else:
                rows = await self._pool.fetch(
                    f"SELECT {_COLUMNS} FROM iop_qualifications WHERE model = $1"
                    " ORDER BY created_ms DESC LIMIT $2",
                    model,
                    MAX_LISTED,
                )
        return [stored(tuple(row)) for row in rows]
