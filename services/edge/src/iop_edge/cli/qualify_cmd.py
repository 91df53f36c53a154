"""``iopctl qualify``: run the suite against a model's providers and store the reports;
``qualify list``, ``qualify show ID``, ``qualify compare A B`` read them back
(docs/ARCHITECTURE.md#qualification-reports). Needs an operator key (or the open API)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, TextIO

from iop_edge.cli.edge_client import CtlError, EdgeClient, Row
from iop_edge.cli.qualify_suite import SuiteOptions, pick_providers, qualify_provider
from iop_edge.cli.qualify_view import compare_screen, comparison, list_screen, report_screen

PATH = "/iop/v1/qualifications"
READERS = ("list", "show", "compare")


def add_parser(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    """``qualify``'s arguments, under ``iopctl``'s subcommands."""
    q = commands.add_parser(
        "qualify",
        parents=parents,
        help="run the qualification suite on a model's providers; list, show, compare reports",
        description=(
            "iopctl qualify MODEL [--provider P]: run the suite through the pool, one provider"
            " at a time, and store each report. iopctl qualify list [MODEL] | show ID |"
            " compare ID_A ID_B: read them."
        ),
    )
    q.add_argument("target", metavar="MODEL|list|show|compare")
    q.add_argument("names", nargs="*", metavar="ARG", help="list: a model; show: ID; compare: A B")
    q.add_argument(
        "--provider",
        action="append",
        default=[],
        metavar="[NODE/]PROVIDER",
        help="only this provider (repeatable; default: every provider of the model)",
    )
    q.add_argument(
        "--levels", type=_levels, default=(1, 4, 16), help="concurrency levels (default 1,4,16)"
    )
    q.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    q.add_argument("--rounds", type=int, default=2, help="requests per stream a level (default 2)")
    q.add_argument("--determinism-runs", type=int, default=5, help="t=0 repeats (default 5)")
    q.add_argument(
        "--context-timeout", type=float, default=120.0, help="seconds to grow the prompt for"
    )
    q.add_argument("--no-store", action="store_true", help="print the reports, store none")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("a list of integers, like 1,4,16") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("each level must be at least 1")
    return levels


async def cmd_qualify(
    client: EdgeClient, args: argparse.Namespace, out: TextIO, err: TextIO
) -> None:
    if args.target in READERS:
        await _read(client, args, out)
        return
    if args.names:
        raise CtlError(f"qualify {args.target}: unexpected {' '.join(args.names)}")
    reports = await run_suite(client, args, err)
    _emit(out, reports if args.json else "\n\n".join(report_screen(r) for r in reports))


async def run_suite(client: EdgeClient, args: argparse.Namespace, err: TextIO) -> list[Row]:
    models = {m["id"]: m for m in await client.data("/iop/v1/catalog/models")}
    model = models.get(args.target)
    if model is None:
        raise CtlError(f"no model {args.target!r} in the catalog")
    providers = pick_providers(model, await client.data("/iop/v1/catalog/providers"), args.provider)
    if not providers:
        raise CtlError(f"{args.target} has no provider to qualify")
    declared = int(
        (await client.send("GET", f"/v1/models/{args.target}")).get("context_window") or 0
    )
    options = SuiteOptions(
        levels=args.levels,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        determinism_runs=args.determinism_runs,
        context_timeout_s=args.context_timeout,
    )

    def say(line: str) -> None:
        err.write(line + "\n")
        err.flush()

    reports = []
    for provider in providers:
        report = await qualify_provider(client, model, provider, declared, options, say)
        if not args.no_store:
            stored = await client.send("POST", PATH, document=report, ok=201)
            report = {**report, "id": stored["id"], "created_ms": stored["created_ms"]}
        reports.append(report)
    return reports


async def _read(client: EdgeClient, args: argparse.Namespace, out: TextIO) -> None:
    names = args.names
    if args.target == "list":
        query: dict[str, int | str] = {"model": names[0]} if names else {}
        rows = (await client.send("GET", PATH, query=query))["data"]
        _emit(out, rows if args.json else list_screen(rows))
    elif args.target == "show":
        if len(names) != 1:
            raise CtlError("qualify show takes one report id")
        report = await client.send("GET", f"{PATH}/{names[0]}")
        _emit(out, report if args.json else report_screen(report))
    else:
        if len(names) != 2:
            raise CtlError("qualify compare takes two report ids")
        a = await client.send("GET", f"{PATH}/{names[0]}")
        b = await client.send("GET", f"{PATH}/{names[1]}")
        if args.json:
            _emit(out, {"a": a["id"], "b": b["id"], "rows": comparison(a, b)})
        else:
            _emit(out, compare_screen(a, b))


def _emit(out: TextIO, value: object) -> None:
    out.write((value if isinstance(value, str) else json.dumps(value, indent=2)) + "\n")
    out.flush()
