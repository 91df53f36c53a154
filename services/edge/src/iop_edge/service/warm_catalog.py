"""Warm/cold and load times in the catalog (docs/ARCHITECTURE.md#warm-aware-scheduling):
what each provider holds in memory, by its node's last snapshot."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from iop_edge.domain.warmth import LoadReport


def warmth_fields(report: LoadReport | None, names: Iterable[str]) -> dict[str, Any]:
    """The provider's memory for its served ``names``: ``on_demand`` false for a provider
    that holds every model always (vLLM, llama.cpp: all warm, no load times)."""
    if report is None:
        models = [_row(name, True) for name in names]
        return {"on_demand": False, "max_loaded": 0, "models": models}
    rows = []
    for name in names:
        row = _row(name, name in report.loaded)
        since, expires = report.loaded.get(name, (0, 0))
        row["loaded_since_ms"] = since or None
        row["expires_ms"] = expires or None
        timing = report.timings.get(name)
        if timing is not None:
            row.update(last_load_ms=timing.last_ms, mean_load_ms=timing.mean_ms, loads=timing.loads)
        rows.append(row)
    return {"on_demand": True, "max_loaded": report.max_loaded, "models": rows}


def warm_provider_ids(served: Iterable[tuple[str, str, LoadReport | None, bool]]) -> list[str]:
    """Of a model's (provider id, served name, report, usable) the usable ones holding it."""
    return [
        provider_id
        for provider_id, name, report, usable in served
        if usable and (report is None or name in report.loaded)
    ]


def _row(name: str, warm: bool) -> dict[str, Any]:
    return {
        "name": name,
        "warm": warm,
        "loaded_since_ms": None,
        "expires_ms": None,
        "last_load_ms": None,
        "mean_load_ms": None,
        "loads": 0,
    }
