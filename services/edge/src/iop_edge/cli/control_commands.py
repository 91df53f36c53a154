"""``iopctl``'s runtime control commands (docs/ARCHITECTURE.md#runtime-control), over the
edge's admin API ``/iop/v1/controls`` with an operator key:

    iopctl disable|enable|drain TARGET [--reason TEXT]    TARGET: NODE or NODE/PROVIDER
    iopctl capacity NODE/PROVIDER N|--clear [--reason TEXT]
    iopctl prefer MODEL P1,P2,...|--clear [--reason TEXT]
    iopctl controls [--audit] [--limit N] [--json]
    iopctl revert CHANGE_ID [--reason TEXT]

Every change prints its change id (what ``revert`` takes) and what it changed; the edge
answers once the control-plane stored it and pushed it to every edge.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final, Protocol, TextIO

import aiohttp

REQUEST_TIMEOUT_S: Final = 15.0
CONTROLS_PATH: Final = "/iop/v1/controls"
STATES: Final = {"disable": "disabled", "enable": "", "drain": "draining"}

Row = dict[str, Any]


class ControlError(Exception):
    """An expected failure of a control command: one line on stderr, exit status 1."""


class Client(Protocol):
    url: str


def add_control_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    sub: list[argparse.ArgumentParser],
) -> None:
    """The control commands' parsers, beside ``iopctl``'s own (``sub``: the shared options)."""
    for name, what in (
        ("disable", "take a provider or node out of selection"),
        ("enable", "put a disabled or draining provider or node back"),
        ("drain", "no new work; running work finishes, queued work goes elsewhere"),
    ):
        command = commands.add_parser(name, parents=sub, help=what)
        command.add_argument("target", metavar="TARGET", help="NODE or NODE/PROVIDER")
        _reason(command)
    capacity = commands.add_parser("capacity", parents=sub, help="override a provider's capacity")
    capacity.add_argument("target", metavar="NODE/PROVIDER")
    capacity.add_argument("capacity", nargs="?", metavar="N", help="the capacity to use")
    capacity.add_argument("--clear", action="store_true", help="back to the fleet file's")
    _reason(capacity)
    prefer = commands.add_parser("prefer", parents=sub, help="a model's provider order")
    prefer.add_argument("target", metavar="MODEL")
    prefer.add_argument("providers", nargs="?", metavar="P1,P2", help="provider ids, first first")
    prefer.add_argument("--clear", action="store_true", help="back to the normal rule")
    _reason(prefer)
    controls = commands.add_parser("controls", parents=sub, help="runtime controls in force")
    controls.add_argument("--audit", action="store_true", help="the audit trail of changes")
    controls.add_argument("--limit", type=int, default=50, help="audit entries (default 50)")
    revert = commands.add_parser("revert", parents=sub, help="undo a runtime control change")
    revert.add_argument("change_id", metavar="CHANGE_ID")
    _reason(revert)


def _reason(command: argparse.ArgumentParser) -> None:
    command.add_argument("--reason", default="", help="why, for the audit trail")


def _request(args: argparse.Namespace) -> tuple[str, str, Row | None]:
    """The method, path and body of a command."""
    command = args.command
    if command == "controls":
        return "GET", f"{CONTROLS_PATH}?audit={max(args.limit, 1)}", None
    if command == "revert":
        return "POST", f"{CONTROLS_PATH}/{args.change_id}/revert", {"reason": args.reason}
    if command in STATES:
        body = {"kind": "state", "target": args.target, "value": STATES[command]}
    else:
        given = args.capacity if command == "capacity" else args.providers
        if args.clear == (given is not None):
            what = "N" if command == "capacity" else "P1,P2"
            raise ControlError(f"{command}: give {what} or --clear (one of them)")
        body = {"kind": command, "target": args.target, "value": "" if args.clear else given}
    return "POST", CONTROLS_PATH, {**body, "reason": args.reason}


async def cmd_control(client: Client, args: argparse.Namespace, out: TextIO, _: TextIO) -> None:
    method, path, body = _request(args)
    answer = await _call(client.url, args.key, method, path, body)
    if args.json:
        out.write(json.dumps(answer, indent=2) + "\n")
    elif args.command == "controls":
        out.write(_audit_table(answer["audit"]) if args.audit else _controls_table(answer))
    else:
        change = answer.get("change")
        out.write(_change_line(change) if change else "unchanged: already so\n")


async def _call(url: str, key: str, method: str, path: str, body: Row | None) -> Row:
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(method, f"{url}{path}", json=body, headers=headers) as response,
        ):
            text = await response.text()
            if response.status != 200:
                raise ControlError(f"HTTP {response.status}: {_message(text)}")
            answer: Row = json.loads(text)
            return answer
    except aiohttp.ClientError as exc:
        raise ControlError(f"cannot reach the edge at {url}: {exc}") from exc
    except TimeoutError as exc:
        raise ControlError(f"the edge at {url} did not answer in time") from exc


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()


def _when(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _shown(value: str, kind: str) -> str:
    if value:
        return value
    return {"state": "serving", "capacity": "fleet file", "prefer": "normal rule"}.get(kind, "-")


def _change_line(c: Row) -> str:
    reverts = f" (reverts {c['reverts']})" if c.get("reverts") else ""
    return (
        f"{c['change_id']}: {c['kind']} {c['target']}: {_shown(c['before'], c['kind'])}"
        f" -> {_shown(c['after'], c['kind'])}{reverts}, by {c['changed_by']}"
        f" at {_when(c['at_ms'])}\n"
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines) + "\n"


def _controls_table(answer: Row) -> str:
    rows = [
        [
            c["kind"],
            c["target"],
            c["value"],
            c["changed_by"],
            _when(c["changed_at_ms"]),
            c["change_id"],
            c["reason"] or "-",
        ]
        for c in answer["controls"]
    ]
    if not rows:
        return "no runtime control in force: the fleet file rules\n"
    return _table(("KIND", "TARGET", "VALUE", "BY", "AT", "CHANGE", "REASON"), rows)


def _audit_table(audit: list[Row]) -> str:
    rows = [
        [
            _when(c["at_ms"]),
            c["change_id"],
            c["changed_by"],
            c["kind"],
            c["target"],
            _shown(c["before"], c["kind"]),
            _shown(c["after"], c["kind"]),
            c["reason"] or "-",
            c.get("reverts") or "-",
        ]
        for c in audit
    ]
    headers = ("AT", "CHANGE", "BY", "KIND", "TARGET", "BEFORE", "AFTER", "REASON", "REVERTS")
    return _table(headers, rows)


def control_verdict(provider: Row, verdict: str | None) -> str | None:
    """The health column's note for ``iopctl providers``: the edge's verdict, and an
    operator's state beside it (``draining 2`` with its runs in flight, ``drained``)."""
    control = provider.get("control") or {}
    state = control.get("state", "serving")
    if state == "serving":
        return verdict
    if state == "draining":
        state = f"draining {control.get('in_flight', 0)}"
    return f"{verdict}, {state}" if verdict else state


def held_load(provider: Row) -> tuple[str, str] | None:
    """The capacity and load cells of a provider an operator holds (disabled, draining,
    drained): ``0/2`` and the state, rather than the ``0/0`` and 100% its zero capacity
    (the truth selection uses, which the JSON keeps) would print; None while it serves."""
    control = provider.get("control") or {}
    held = control.get("held_capacity")
    if held is None:
        return None
    return f"{provider['in_flight']}/{held}", str(control.get("state", "held"))


CONTROL_COMMANDS: Final = {
    name: cmd_control
    for name in ("disable", "enable", "drain", "capacity", "prefer", "controls", "revert")
}
