"""``iopctl``: the edge's provider and model catalog and its run history, in a terminal.

Read-only (docs/ARCHITECTURE.md#catalog), like the web console: it reads only the
documented endpoints
``/iop/v1/catalog/providers``, ``/iop/v1/catalog/models``, ``/iop/v1/runs`` and
``/iop/v1/usage``,
with the same Bearer key as the API. ``--json`` prints an endpoint's ``data`` so
scripts never parse the tables; the live commands (``runs --tail``, ``watch``)
print one JSON document per line instead.

``iopctl qualify`` is the exception that writes: it runs the qualification suite through
the pool and stores its reports (``qualify_cmd``; docs/ARCHITECTURE.md#qualification-reports).

Any failure is one line on stderr and exit status 1; Ctrl-C ends the live
commands with status 0, because that is how they are meant to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TextIO

import aiohttp

from iop_edge.cli.control_commands import (
    CONTROL_COMMANDS,
    ControlError,
    add_control_commands,
    control_verdict,
    held_load,
)
from iop_edge.cli.edge_client import CtlError, EdgeClient, KeyRejected, Row, table
from iop_edge.cli.qualify_cmd import add_parser as add_qualify_parser
from iop_edge.cli.qualify_cmd import cmd_qualify
from iop_edge.cli.usage_view import usage_screen

DEFAULT_URL: Final = "http://127.0.0.1:8080"
REQUEST_TIMEOUT_S: Final = 10.0
TAIL_WINDOW: Final = 200  # runs read per poll while tailing: the newest of them are new
CLEAR_SCREEN: Final = "\x1b[H\x1b[2J"

PROVIDER_HEADERS: Final = (
    "PROVIDER", "NODE", "TYPE", "HEALTH", "IN_FLIGHT/CAP", "LOAD", "QUEUED", "CACHE_HIT",
    "WARM", "MODELS",
)  # fmt: skip
MODEL_HEADERS: Final = ("ID", "NAME", "AVAILABLE/PROVIDERS", "WARM", "QUEUED")
RUN_HEADERS: Final = (
    "RECEIVED", "RUN", "MODEL", "PROVIDER", "WAIT", "TTFT", "DURATION", "TOKENS", "CACHED",
    "OUTCOME",
)  # fmt: skip
# Tailed rows cannot be re-aligned once printed: fixed widths that fit the usual values.
RUN_WIDTHS: Final = (8, 32, 16, 16, 8, 8, 8, 9, 6, 0)


def provider_row(p: Row) -> list[object]:
    # an operator's held provider: its capacity once enabled and its state (control_commands)
    in_flight, load = held_load(p) or (
        f"{p['in_flight']}/{p['capacity']}",
        f"{round(p['load_ratio'] * 100)}%",
    )
    return [
        p["provider_id"],
        p["node_id"],
        p["type"],
        _health(p),
        in_flight,
        load,
        p["queued"],
        _hit_rate(p),
        _warm_cell(p),
        ",".join(p.get("serves") or p.get("models") or []) or "-",
    ]


def _hit_rate(p: Row) -> str:
    """The share of the provider's prompt tokens its engine served from its cache; "-"
    before any was reported (or from an edge that does not say)."""
    rate = (p.get("cache") or {}).get("hit_rate")
    return "-" if rate is None else f"{round(rate * 100)}%"


def _warm_cell(p: Row) -> str:
    """Each served model warm or cold, with its last load time (docs/ARCHITECTURE.md#warm-
    aware-scheduling): "always" for a provider that holds every model (vLLM, llama.cpp),
    "-" from an edge that does not say."""
    warmth = p.get("warmth")
    if not warmth:
        return "-"
    if not warmth["on_demand"]:
        return "always"
    cells = []
    for row in warmth["models"]:
        load = row.get("last_load_ms")
        took = f"({_ms(load)})" if load else ""
        cells.append(f"{row['name']}:{'warm' if row['warm'] else 'cold'}{took}")
    return ",".join(cells) or "-"


def _health(p: Row) -> str:
    """The node's word, and the edge's outlier verdict beside it when there is one."""
    verdict = {"ejected": "ejected", "half_open": "on trial"}.get(p.get("outlier_state", ""))
    verdict = control_verdict(p, verdict)  # an operator's disable or drain, when one is on
    return f"{p['health']} ({verdict})" if verdict else str(p["health"])


def model_row(m: Row) -> list[object]:
    return [
        m["id"],
        m["display_name"] or m["id"],
        f"{len(m['available_providers'])}/{len(m['providers'])}",
        len(m["warm_providers"]) if "warm_providers" in m else "-",  # usable ones holding it
        m["queued"],
    ]


def run_row(r: Row) -> list[object]:
    outcome = " ".join(str(v) for v in (r["outcome"], r["status"] or "", r["error_code"]) if v)
    # A run that failed over lists its earlier attempts (docs/ARCHITECTURE.md#failover);
    # PROVIDER is the one that answered. An edge from before attempts sends none.
    earlier = (r.get("attempts") or [])[:-1]
    if earlier:
        tried = (f"{a['provider_id']} {a['error_code'] or a['outcome']}" for a in earlier)
        outcome += " after " + ", ".join(tried)
    return [
        _clock(r["received_ms"]),
        r["run_id"] or "-",
        r["model"],
        r["provider_id"] or "-",
        _ms(r["queue_wait_ms"], zero="0ms"),
        _ms(r["ttft_ms"]),
        _ms(r["duration_ms"]),
        f"{r['prompt_tokens']}/{r['completion_tokens']}",
        r.get("cached_tokens", "-"),  # of the prompt tokens; an older edge does not say
        outcome,
    ]


def fixed_row(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def _ms(value: int, zero: str = "-") -> str:
    if not value:
        return zero
    return f"{value}ms" if value < 1000 else f"{value / 1000:.2f}s"


def _clock(unix_ms: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_ms / 1000)) if unix_ms else "-"


# ---------------------------------------------------------------- commands


async def cmd_providers(
    client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO
) -> None:
    rows = await client.data("/iop/v1/catalog/providers")
    _print(out, rows if args.json else table(PROVIDER_HEADERS, [provider_row(p) for p in rows]))


async def cmd_models(
    client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO
) -> None:
    rows = await client.data("/iop/v1/catalog/models")
    _print(out, rows if args.json else table(MODEL_HEADERS, [model_row(m) for m in rows]))


async def cmd_runs(client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    if args.tail:
        await _tail(client, args, out, err)
        return
    runs = await client.data("/iop/v1/runs", limit=args.limit)
    # The endpoint is newest first; the table reads top to bottom like a log.
    _print(out, runs if args.json else table(RUN_HEADERS, [run_row(r) for r in runs[::-1]]))


async def _tail(client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    """The newest ``--limit`` runs, then every run not seen before, oldest first.

    Each poll reads a wider window than it prints: a long run is listed by when it
    was received but appears only when it ends, below newer runs already printed.
    """
    window = max(args.limit, TAIL_WINDOW)
    runs = await client.data("/iop/v1/runs", limit=window)
    fresh = runs[: args.limit]
    if not args.json:
        _line(out, fixed_row(RUN_HEADERS, RUN_WIDTHS))
    while True:
        for run in fresh[::-1]:
            _line(out, _json_line(run) if args.json else fixed_row(run_row(run), RUN_WIDTHS))
        # Only the current window can hold a run not yet printed, so this stays bounded.
        seen = {_run_key(r) for r in runs}
        await asyncio.sleep(args.interval)
        runs = await _retrying(lambda: client.data("/iop/v1/runs", limit=window), err)
        fresh = [r for r in runs if _run_key(r) not in seen]


async def cmd_usage(client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    query = {} if args.of is None else {"key": args.of}
    views = await client.data("/iop/v1/usage", **query)
    _print(out, views if args.json else usage_screen(views, table))


async def cmd_watch(client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    providers = await client.data("/iop/v1/catalog/providers")
    models = await client.data("/iop/v1/catalog/models")
    problem = ""
    while True:
        if args.json:
            _line(out, _json_line({"providers": providers, "models": models}))
        else:
            _print(out, CLEAR_SCREEN + _watch_screen(client.url, args, providers, models, problem))
        await asyncio.sleep(args.interval)
        try:
            providers = await client.data("/iop/v1/catalog/providers")
            models = await client.data("/iop/v1/catalog/models")
            problem = ""
        except KeyRejected:
            raise
        except CtlError as exc:
            # An edge restarting is worth watching through: keep the last tables.
            problem = f"{exc}; retrying"


def _watch_screen(
    url: str, args: argparse.Namespace, providers: list[Row], models: list[Row], problem: str
) -> str:
    title = f"iopctl watch  {url}  every {args.interval:g}s  {time.strftime('%H:%M:%S')}"
    return "\n\n".join(
        part
        for part in (
            f"{title}  (Ctrl-C to quit)",
            f"! {problem}" if problem else "",
            table(PROVIDER_HEADERS, [provider_row(p) for p in providers]),
            table(MODEL_HEADERS, [model_row(m) for m in models]),
        )
        if part
    )


async def _retrying(read: Callable[[], Awaitable[list[Row]]], err: TextIO) -> list[Row]:
    """``read()`` until it succeeds, saying once on stderr that the edge is away."""
    reported = False
    while True:
        try:
            rows = await read()
        except KeyRejected:
            raise
        except CtlError as exc:
            if not reported:
                _line(err, f"iopctl: {exc}; retrying")
                reported = True
            await asyncio.sleep(1.0)
            continue
        if reported:
            _line(err, "iopctl: the edge answers again")
        return rows


def _run_key(run: Row) -> str:
    return str(run["run_id"]) or json.dumps(run, sort_keys=True)


def _json_line(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _print(out: TextIO, value: object) -> None:
    _line(out, value if isinstance(value, str) else json.dumps(value, indent=2))


def _line(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()  # a pipe (``| grep``, a test) sees each live line as it comes


# ---------------------------------------------------------------- entry point


def parser() -> argparse.ArgumentParser:
    # The shared options are accepted before and after the command; after it they
    # default to SUPPRESS so they never overwrite a value given before it.
    def shared(defaults: bool) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(add_help=False)

        def d(value: object) -> object:
            return value if defaults else argparse.SUPPRESS

        p.add_argument(
            "--url",
            default=d(os.environ.get("IOP_EDGE_URL", DEFAULT_URL)),
            help=f"the edge's HTTP API (env IOP_EDGE_URL, default {DEFAULT_URL})",
        )
        p.add_argument(
            "--key", default=d(os.environ.get("IOP_API_KEY", "")), help="API key (env IOP_API_KEY)"
        )
        p.add_argument(
            "--json", action="store_true", default=d(False), help="print the data as JSON"
        )
        return p

    top = argparse.ArgumentParser(
        prog="iopctl",
        description=(
            "Read the IOP edge's provider and model catalog, its run history and each key's usage."
        ),
        parents=[shared(True)],
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = [shared(False)]
    commands.add_parser("providers", parents=sub, help="provider health, load and queue")
    commands.add_parser("models", parents=sub, help="available providers and queue per model")
    runs = commands.add_parser("runs", parents=sub, help="the edge's recent runs")
    runs.add_argument("--limit", type=_positive_int, default=20, help="how many (default 20)")
    runs.add_argument("--tail", action="store_true", help="keep printing new runs (Ctrl-C stops)")
    runs.add_argument(
        "--interval", type=_positive_float, default=1.0, help="seconds between polls with --tail"
    )
    usage = commands.add_parser(
        "usage", parents=sub, help="each key's use against its limits, and by API"
    )
    usage.add_argument(
        "of", nargs="?", metavar="KEY", help="one key, by its id or name (default: every key)"
    )
    add_qualify_parser(commands, sub)
    watch = commands.add_parser("watch", parents=sub, help="a live table (Ctrl-C stops)")
    watch.add_argument("--interval", type=_positive_float, default=1.0, help="seconds (default 1)")
    add_control_commands(commands, sub)  # runtime control, with an operator key
    return top


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return value


COMMANDS: Final = {
    "providers": cmd_providers,
    "models": cmd_models,
    "runs": cmd_runs,
    "usage": cmd_usage,
    "watch": cmd_watch,
    **CONTROL_COMMANDS,
    "qualify": cmd_qualify,
}


async def run(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Run one command; the exit status. Tests call this; ``main`` adds Ctrl-C handling."""
    args = parser().parse_args(argv)
    url = args.url.rstrip("/").removesuffix("/v1")  # the OpenAI base URL works too
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await COMMANDS[args.command](EdgeClient(session, url, args.key), args, out, err)
    except (CtlError, ControlError) as exc:
        _line(err, f"iopctl: {exc}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``iopctl`` console script."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        return asyncio.run(run(arguments, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how ``watch`` and ``runs --tail`` end
    except BrokenPipeError:
        # ``iopctl runs --tail | head``: the reader has what it wanted. Point stdout at
        # /dev/null so the interpreter's final flush does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
