"""Rows of the report: one measured metric each, side by side, with its target.

A row holds numbers, never formatted text, so the JSON can be compared across
runs; ``render`` makes the table people read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

PEERS: Final = ("litellm", "vllm_router", "sglang_router")
"""The other gateways, each a column: LiteLLM's proxy and the two Rust routers."""


@dataclass
class Row:
    """One metric of one scenario, as IOP, direct and the peers measured it in the same run.

    A peer's value (``litellm``, ``vllm_router``, ``sglang_router``) is a number, or
    the reason it is missing (``skipped (...)``, ``not installed (...)``).
    ``ratio`` is the quantity the target is about; ``ratio_of`` says what it divides.
    ``met`` is ``None`` where the row has no target.
    """

    scenario: str
    metric: str
    unit: str
    iop: float | None = None
    direct: float | None = None
    litellm: float | str | None = None
    ratio: float | None = None
    ratio_of: str = ""
    target: str = ""
    met: bool | None = None
    vllm_router: float | str | None = None
    sglang_router: float | str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: _finite(v) for k, v in asdict(self).items()}


def _finite(value: Any) -> Any:
    """JSON has no NaN: a value that could not be measured is ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def peer_cells(
    value: Callable[[str], float | None], missing: Mapping[str, str]
) -> dict[str, float | str | None]:
    """Each peer's cell of a row: ``value(peer)``, or why the peer is not in this run."""
    return {name: missing[name] if name in missing else value(name) for name in PEERS}


def ratio(numerator: float | None, denominator: float | str | None) -> float | None:
    if numerator is None or not isinstance(denominator, int | float) or denominator == 0:
        return None
    value = numerator / denominator
    return value if math.isfinite(value) else None


@dataclass
class ScenarioResult:
    """What one scenario module returns: its rows and the raw data behind them."""

    name: str
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    rows: list[Row] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "seconds": round(self.seconds, 2),
            "rows": [row.as_json() for row in self.rows],
            "data": _clean(self.data),
        }


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return _finite(value)


def fmt(value: float | str | None) -> str:
    """Three significant digits (more left of the point are kept), or the text as is."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not math.isfinite(value):
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


HEADERS = (
    "scenario", "metric", "IOP", "direct", "LiteLLM", "vllm-router", "sglang-router", "ratio",
    "target", "met?",
)  # fmt: skip


def table_rows(rows: list[Row]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for row in rows:
        met = "" if row.met is None else ("yes" if row.met else "NO")
        ratio_text = f"{fmt(row.ratio)} {row.ratio_of}".strip() if row.ratio is not None else ""
        out.append(
            (
                row.scenario,
                f"{row.metric} ({row.unit})" if row.unit else row.metric,
                fmt(row.iop),
                fmt(row.direct),
                fmt(row.litellm),
                fmt(row.vllm_router),
                fmt(row.sglang_router),
                ratio_text,
                row.target,
                met,
            )
        )
    return out


def render(rows: list[Row], *, markdown: bool = False) -> str:
    """The table: aligned plain text for the terminal, or Markdown for the README."""
    body = table_rows(rows)
    if markdown:
        lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(HEADERS)]
    line = "  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True))
    lines = [line, "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)
