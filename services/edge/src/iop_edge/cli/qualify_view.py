"""Qualification reports as a user reads them: one report (``iopctl qualify``, ``qualify
show``), the list, and two reports side by side with their differences (``qualify
compare``: before and after an engine upgrade, or two providers of one alias)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from iop_edge.cli.edge_client import Row, table

LIST_HEADERS: Final = (
    "ID", "CREATED", "MODEL", "PROVIDER", "ENGINE", "TTFT_P50", "TOK/S", "AGG_TOK/S", "CONTEXT",
    "TOOLS", "JSON", "DETERMINISTIC",
)  # fmt: skip
PERF_HEADERS: Final = (
    "CONCURRENCY", "REQUESTS", "FAILED", "TTFT_P50", "TOK/S_SINGLE", "TOK/S_AGGREGATE",
)  # fmt: skip


def engine_text(engine: Row) -> str:
    if not engine:
        return "-"
    return f"{engine.get('name') or '?'} {engine.get('version') or '(version unknown)'}"


def _created(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ms / 1000)) if ms else "-"


def _num(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:g}{unit}" if isinstance(value, int | float) else str(value)


def list_screen(rows: Sequence[Row]) -> str:
    return table(
        LIST_HEADERS,
        [
            [
                r["id"],
                _created(r["created_ms"]),
                r["model"],
                f"{r['node_id']}/{r['provider_id']}",
                engine_text(r.get("engine") or {}),
                _num(r["summary"].get("ttft_p50_ms"), "ms"),
                _num(r["summary"].get("tokens_per_s_single")),
                _num(r["summary"].get("tokens_per_s_aggregate_best")),
                _num(r["summary"].get("context_reached_tokens")),
                r["summary"].get("tool_call", "-"),
                r["summary"].get("json_schema", "-"),
                "yes" if r["summary"].get("deterministic") else "no",
            ]
            for r in rows
        ],
    )


def _verdict(check: Row) -> str:
    return "pass" if check.get("passed") else f"FAIL: {check.get('reason') or 'no reason given'}"


def _context(context: Row) -> str:
    refused = context.get("refused_at_words")
    text = (
        f"{context.get('reached_tokens', 0)} tokens accepted; stopped by {context.get('stopped')}"
    )
    if refused:
        text += f" (refused a prompt of ~{refused} words)"
    declared = context.get("declared")
    return text + (f"; declared window {declared}" if declared else "; no window declared")


def _determinism(d: Row) -> str:
    verdict = "identical" if d.get("identical") else "NOT identical"
    text = f"{verdict}: {d.get('distinct')} distinct of {d.get('answered')}/{d.get('runs')} answers"
    return text + (f" ({d['first_error']})" if d.get("first_error") else "")


def report_screen(report: Row) -> str:
    engine = report.get("engine") or {}
    head = [
        f"Qualification {report.get('id', '(not stored)')}"
        f"  {_created(report.get('created_ms', 0))}",
        f"  model      {report['model']} (served as {report.get('served_as')})",
        f"  provider   {report['node_id']}/{report['provider_id']} ({report.get('provider_type')})",
        f"  engine     {engine_text(engine)}",
        f"  device     {engine.get('device') or '-'}",
        f"  took       {report.get('duration_s')} s",
    ]
    perf = table(
        PERF_HEADERS,
        [
            [
                row["concurrency"],
                row["requests"],
                row["failed"],
                _num(row["ttft_p50_ms"], "ms"),
                _num(row["tokens_per_s_single"]),
                _num(row["tokens_per_s_aggregate"]),
            ]
            for row in report["performance"]
        ],
    )
    failures = [
        f"  c={row['concurrency']}: {row['failed']} failed, the first: {row['first_failure']}"
        for row in report["performance"]
        if row["failed"] and row.get("first_failure")
    ]
    checks = [
        *failures,
        f"  context        {_context(report['context'])}",
        f"  tool call      {_verdict(report['tool_call'])}",
        f"  JSON schema    {_verdict(report['json_schema'])}",
        f"  determinism    {_determinism(report['determinism'])}",
    ]
    for flag, check in report["lifecycle"].items():
        claimed = "claimed" if check["claimed"] else "not claimed"
        checks.append(f"  {flag:<14} {claimed}: {check['checked']} ({check['reason']})")
    return "\n".join([*head, "", _indent(perf), "", *checks])


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return "-" if a == b else "changed"
    if a == 0:
        return "-" if b == 0 else "new"
    return f"{b - a:+g} ({b / a:.2f}x)"


def comparison(a: Row, b: Row) -> list[Row]:
    """The two reports' figures row by row, with B's change against A."""
    metrics: list[tuple[str, Callable[[Row], Any]]] = [
        ("provider", lambda r: f"{r['node_id']}/{r['provider_id']}"),
        ("engine", lambda r: engine_text(r.get("engine") or {})),
        ("device", lambda r: (r.get("engine") or {}).get("device") or "-"),
    ]
    levels = sorted(
        {row["concurrency"] for row in a["performance"]}
        & {row["concurrency"] for row in b["performance"]}
    )
    for level in levels:
        for key, name in (
            ("ttft_p50_ms", "ttft p50 ms"),
            ("tokens_per_s_single", "tok/s single"),
            ("tokens_per_s_aggregate", "tok/s aggregate"),
            ("failed", "failed requests"),
        ):
            metrics.append((f"c={level} {name}", _level_metric(level, key)))
    metrics += [
        ("context reached", lambda r: r["context"]["reached_tokens"]),
        ("tool call", lambda r: r["summary"]["tool_call"]),
        ("JSON schema", lambda r: r["summary"]["json_schema"]),
        ("distinct answers at t=0", lambda r: r["determinism"]["distinct"]),
        ("lifecycle flags", lambda r: r["summary"]["lifecycle"]),
    ]
    return [
        {"metric": name, "a": read(a), "b": read(b), "change": _ratio(read(a), read(b))}
        for name, read in metrics
    ]


def _level_metric(level: int, key: str) -> Callable[[Row], Any]:
    def read(report: Row) -> Any:
        return next(r[key] for r in report["performance"] if r["concurrency"] == level)

    return read


def compare_screen(a: Row, b: Row) -> str:
    rows = comparison(a, b)
    title = f"A = {a['id']} ({a['model']})   B = {b['id']} ({b['model']})"
    body = table(
        ("METRIC", "A", "B", "B vs A"),
        [[r["metric"], _num(r["a"]), _num(r["b"]), r["change"]] for r in rows],
    )
    return f"{title}\n\n{body}"
