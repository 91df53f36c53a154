"""Qualification reports in one SQLite file beside the edge (``QualificationStore``).

Reports are few (an operator's runs of ``iopctl qualify``) and each is written once, so
each ``add`` commits at once: no batching writer, nothing to lose at a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import aiosqlite
from loguru import logger

from iop_edge.qualification_ports import MAX_LISTED, StoredReport
from iop_proto import json_codec
from iop_proto.sqlite import open_database

SCHEMA_VERSION = 1
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS qualifications (
        report_id   TEXT PRIMARY KEY,
        model       TEXT NOT NULL,
        provider_id TEXT NOT NULL,
        node_id     TEXT NOT NULL,
        created_ms  INTEGER NOT NULL,
        report      TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS qualifications_model ON qualifications (model, created_ms)",
    "CREATE INDEX IF NOT EXISTS qualifications_created ON qualifications (created_ms)",
)
_COLUMNS = "report_id, model, provider_id, node_id, created_ms, report"


class QualificationStoreError(Exception):
    """The file cannot be used (a schema from a newer edge)."""


def stored(row: Any) -> StoredReport:
    report_id, model, provider_id, node_id, created_ms, report = row
    document = report if isinstance(report, dict) else json_codec.loads(report)
    return StoredReport(report_id, model, provider_id, node_id, int(created_ms), document)


class SqliteQualifications:
    """``QualificationStore`` on one aiosqlite connection; ``await open(path)``, then
    ``aclose()``."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    @classmethod
    async def open(cls, path: Path, busy_timeout_s: float = 5.0) -> Self:
        db = await open_database(
            path,
            busy_timeout_s=busy_timeout_s,
            what="qualification reports",
            owner="edge",
            schema=_SCHEMA,
            schema_version=SCHEMA_VERSION,
            synchronous="FULL",
            error=QualificationStoreError,
        )
        logger.info("qualification reports {}: opened", path)
        return cls(db)

    async def aclose(self) -> None:
        await self._db.close()

    async def add(self, report: StoredReport) -> None:
        await self._db.execute(
            f"INSERT INTO qualifications ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
            (
                report.report_id,
                report.model,
                report.provider_id,
                report.node_id,
                report.created_ms,
                json_codec.dumps(report.report).decode(),
            ),
        )
        await self._db.commit()

    async def get(self, report_id: str) -> StoredReport | None:
        async with self._db.execute(
            f"SELECT {_COLUMNS} FROM qualifications WHERE report_id = ?", (report_id,)
        ) as cursor:
            row = await cursor.fetchone()
        return None if row is None else stored(row)

    async def recent(self, model: str | None = None) -> list[StoredReport]:
        if model is None:
            query = f"SELECT {_COLUMNS} FROM qualifications ORDER BY created_ms DESC LIMIT ?"
            parameters: tuple[object, ...] = (MAX_LISTED,)
        else:
            query = (
                f"SELECT {_COLUMNS} FROM qualifications WHERE model = ?"
                " ORDER BY created_ms DESC LIMIT ?"
            )
            parameters = (model, MAX_LISTED)
        async with self._db.execute(query, parameters) as cursor:
            rows = await cursor.fetchall()
        return [stored(row) for row in rows]
