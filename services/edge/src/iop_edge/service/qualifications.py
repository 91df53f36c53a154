"""Qualification reports, stored and read (docs/ARCHITECTURE.md#qualification-reports).

``iopctl qualify`` runs the suite through the pool, pinned to one provider at a time,
and posts each provider's report here; the edge checks only what it lists reports by
(the model, the provider, the summary's shape) and keeps the document whole. The
catalog's view is the newest report of each provider of each model.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

from iop_edge.qualification_ports import QualificationStore, StoredReport
from iop_proto import json_codec

MAX_REPORT_BYTES: Final = 1024 * 1024
ID_PREFIX: Final = "qual_"


class BadReport(ValueError):
    """A posted report lacks what it is listed by; the message says what."""


class QualificationBook:
    """Stores and reads reports through one ``QualificationStore``."""

    def __init__(self, store: QualificationStore) -> None:
        self._store = store

    async def add(self, document: dict[str, Any]) -> StoredReport:
        """Store a report ``iopctl qualify`` made; raises ``BadReport``."""
        for field in ("model", "provider_id"):
            if not isinstance(document.get(field), str) or not document[field]:
                raise BadReport(f"'{field}' must be a non-empty string")
        if not isinstance(document.get("summary"), dict):
            raise BadReport("'summary' must be an object")
        node_id = document.get("node_id", "")
        if not isinstance(node_id, str):
            raise BadReport("'node_id' must be a string")
        try:
            size = len(json_codec.dumps(document))
        except (TypeError, ValueError) as exc:  # an integer past 64 bits, say
            raise BadReport(f"it cannot be stored as JSON ({exc})") from None
        if size > MAX_REPORT_BYTES:
            raise BadReport(f"it is {size} bytes, over {MAX_REPORT_BYTES}")
        report = StoredReport(
            report_id=ID_PREFIX + secrets.token_hex(8),
            model=document["model"],
            provider_id=document["provider_id"],
            node_id=node_id,
            created_ms=time.time_ns() // 1_000_000,
            report={k: v for k, v in document.items() if k not in ("id", "created_ms")},
        )
        await self._store.add(report)
        return report

    async def get(self, report_id: str) -> StoredReport | None:
        return await self._store.get(report_id)

    async def listing(self, model: str | None = None) -> list[dict[str, Any]]:
        """Every report's summary, newest first (of ``model`` only, when given)."""
        return [report.summary() for report in await self._store.recent(model)]

    async def latest(self, model: str | None = None) -> list[dict[str, Any]]:
        """The catalog's view: the newest report of each (model, provider), newest first."""
        seen: set[tuple[str, str]] = set()
        views = []
        for report in await self._store.recent(model):
            pair = (report.model, report.provider_id)
            if pair not in seen:
                seen.add(pair)
                views.append(report.summary())
        return views
