"""The port of qualification reports (docs/ARCHITECTURE.md#qualification-reports):
``adapters/sqlite_qualifications.py`` on one edge, ``adapters/pg_qualifications.py``
shared by every edge of a fleet.

A report is the document ``iopctl qualify`` made (``cli/qualify_suite.py``): the store
keeps it whole, with the columns it is listed by. Reports are never changed, only added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

MAX_LISTED = 500
"""The most reports one listing returns, newest first."""


@dataclass(frozen=True, slots=True)
class StoredReport:
    """One stored report: its id, what it qualified, when, and the document."""

    report_id: str
    model: str
    provider_id: str
    node_id: str
    created_ms: int
    report: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        """What a listing shows: the report without its per-check details."""
        return {
            "id": self.report_id,
            "model": self.model,
            "provider_id": self.provider_id,
            "node_id": self.node_id,
            "created_ms": self.created_ms,
            "engine": self.report.get("engine") or {},
            "summary": self.report.get("summary") or {},
        }

    def document(self) -> dict[str, Any]:
        return {**self.report, "id": self.report_id, "created_ms": self.created_ms}


class QualificationStore(Protocol):
    async def add(self, report: StoredReport) -> None:
        """Store a new report (its id is new: ``service.qualifications`` makes it)."""
        ...

    async def get(self, report_id: str) -> StoredReport | None: ...

    async def recent(self, model: str | None = None) -> list[StoredReport]:
        """The newest ``MAX_LISTED`` reports, newest first; of ``model`` only when given."""
        ...
