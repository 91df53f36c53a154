"""``iopctl usage``'s tables: each key's use against its limits, and the split by API.

Reads what ``GET /iop/v1/usage`` answers (docs/ARCHITECTURE.md#usage-per-key). A cell
``used/limit`` shows a limit; a limit of 0 is shown as ``unlimited``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

Row = dict[str, Any]
Table = Callable[[Sequence[str], Sequence[Sequence[object]]], str]

UNLIMITED: Final = "unlimited"
KEY_HEADERS: Final = (
    "KEY", "NAME", "REQ/MIN", "IN_TOK/MIN", "OUT_TOK/MIN", "IN_FLIGHT", "REQ_TODAY",
    "TOK_TODAY", "ERR_TODAY", "BUDGET",
)  # fmt: skip
MODEL_HEADERS: Final = ("KEY", "MODEL", "REQ/MIN", "IN_TOK/MIN", "OUT_TOK/MIN", "BUDGET")
API_HEADERS: Final = (
    "KEY", "API", "REQ/MIN", "REQ_TODAY", "ERR_TODAY", "IN_TOK_TODAY", "OUT_TOK_TODAY",
    "REQ_PERIOD", "TOK_PERIOD",
)  # fmt: skip


def against(used: int, limit: int) -> str:
    return f"{used}/{limit if limit else UNLIMITED}"


def _limits(view: Row) -> Row:
    """The key's limits; a key no longer in the fleet has none: every one unlimited."""
    return view.get("limits") or {}


def _budget(period: Row, limits: Row) -> str:
    return f"{against(period['tokens'], limits.get('token_budget', 0))} ({period['period']})"


def key_row(view: Row) -> list[object]:
    limits, minute, day = _limits(view), view["minute"], view["day"]
    return [
        view["key_id"] or "(none)",
        view["name"] or ("-" if view["in_fleet"] else "(not in the fleet)"),
        against(minute["requests"], limits.get("requests_per_minute", 0)),
        against(minute["input_tokens"], limits.get("input_tokens_per_minute", 0)),
        against(minute["output_tokens"], limits.get("output_tokens_per_minute", 0)),
        against(view["in_flight"], view["max_concurrent"]),
        day["requests"],
        day["tokens"],
        day["errors"],
        _budget(view["period"], limits),
    ]


def model_rows(view: Row) -> list[list[object]]:
    """A key's per-model limits, each against that model's use."""
    return [
        [
            view["key_id"],
            m["model"],
            against(m["minute"]["requests"], m["limits"]["requests_per_minute"]),
            against(m["minute"]["input_tokens"], m["limits"]["input_tokens_per_minute"]),
            against(m["minute"]["output_tokens"], m["limits"]["output_tokens_per_minute"]),
            _budget(m["period"], m["limits"]),
        ]
        for m in view["models"]
    ]


def api_rows(view: Row) -> list[list[object]]:
    """A key's use by API (every API it used in its budget period)."""
    minute, day, period = (view[w]["by_api"] for w in ("minute", "day", "period"))
    zero = {"requests": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0, "tokens": 0}
    rows: list[list[object]] = []
    for api in sorted(set(minute) | set(day) | set(period)):
        today, whole = day.get(api, zero), period.get(api, zero)
        rows.append(
            [
                view["key_id"] or "(none)",
                api or "(before apis were kept)",
                minute.get(api, zero)["requests"],
                today["requests"],
                today["errors"],
                today["input_tokens"],
                today["output_tokens"],
                whole["requests"],
                whole["tokens"],
            ]
        )
    return rows


def usage_screen(views: Sequence[Row], table: Table) -> str:
    """The tables, one after the other; those with nothing to show left out."""
    models = [row for view in views for row in model_rows(view)]
    apis = [row for view in views for row in api_rows(view)]
    parts = [table(KEY_HEADERS, [key_row(v) for v in views])]
    if models:
        parts.append(table(MODEL_HEADERS, models))
    if apis:
        parts.append(table(API_HEADERS, apis))
    return "\n\n".join(parts)
