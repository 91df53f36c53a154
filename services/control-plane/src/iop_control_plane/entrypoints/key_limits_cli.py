"""An API key's limits on the command line: the flags of ``key issue`` and ``key update``.

    key issue --name N [--rpm N] [--input-tpm N] [--output-tpm N]
              [--budget TOKENS [--budget-period day|week|month]] [--weight N] [--priority N]
    key update KEY_ID [--model M [--clear]] [--rpm N] [--input-tpm N] [--output-tpm N]
              [--budget TOKENS] [--budget-period P] [--max-concurrent N]
              [--models A,B] [--weight N] [--priority N]

Without ``--model`` the limit flags change the key's own limits; with ``--model M`` they
change M's entry (on top of the key's: a request on M is held to both), and ``--clear``
drops it. A flag left out leaves its value; 0 removes that limit. ``--max-concurrent``
with ``--model M`` is M's own concurrency; without it, the key's (the column it had
before rates existed). The edge enforces all of it (docs/ARCHITECTURE.md#limits-per-key).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from iop_control_plane.domain.credentials import ApiKey
from iop_control_plane.domain.key_limits import (
    NO_LIMITS,
    BudgetPeriod,
    KeyLimits,
    changed,
    with_model_limits,
)
from iop_control_plane.errors import CredentialError

_FLAGS = (
    ("--rpm", "requests_per_minute", "requests per minute"),
    ("--input-tpm", "input_tokens_per_minute", "input (prompt) tokens per minute"),
    ("--output-tpm", "output_tokens_per_minute", "output tokens per minute"),
    ("--budget", "token_budget", "input + output tokens per budget period"),
)


def add_limit_flags(parser: argparse.ArgumentParser, *, update: bool) -> None:
    """The limit flags; ``update``: each defaults to ``None`` (left as it is)."""
    for flag, dest, what in _FLAGS:
        parser.add_argument(
            flag,
            dest=dest,
            type=_count,
            default=None if update else 0,
            metavar="N",
            help=f"{what} (0: no limit)",
        )
    parser.add_argument(
        "--budget-period",
        dest="budget_period",
        type=BudgetPeriod,
        choices=list(BudgetPeriod),
        default=None if update else BudgetPeriod.MONTH,
        help="the calendar period (UTC) the budget renews over (default: month)",
    )
    parser.add_argument(
        "--weight",
        type=_positive,
        default=None if update else 1,
        metavar="N",
        help="the key's share of turns in a model's queue (default: 1)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None if update else 0,
        metavar="N",
        help="higher is served first (default: 0, interactive)",
    )


def limits_from_args(args: argparse.Namespace) -> KeyLimits:
    """The key's limits ``key issue`` was given."""
    return changed(NO_LIMITS, **_given(args))


def add_update_parser(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """``key update KEY_ID ...`` on ``actions`` (the ``key`` sub-command parser)."""
    update = actions.add_parser("update", help="change an API key's limits, weight or priority")
    update.add_argument("key_id", metavar="KEY_ID", help="as shown by 'key list'")
    update.add_argument(
        "--model", metavar="M", help="the limit flags change model M's limits, not the key's"
    )
    update.add_argument("--clear", action="store_true", help="with --model: drop M's limits")
    update.add_argument(
        "--models",
        type=lambda text: [part.strip() for part in text.split(",") if part.strip()],
        default=None,
        metavar="A,B",
        help="models the key may use ('' : every model)",
    )
    update.add_argument(
        "--max-concurrent",
        type=_count,
        default=None,
        metavar="N",
        help="requests in flight at once (0: no limit); with --model, on that model",
    )
    add_limit_flags(update, update=True)
    return update


def updated(key: ApiKey, args: argparse.Namespace) -> ApiKey:
    """``key`` with what ``args`` (``key update``) changes."""
    given = _given(args)
    changes: dict[str, Any] = {}
    if args.model is not None:
        if args.models is not None:
            raise CredentialError("--models changes the key's model list: leave out --model")
        entry = dict(key.model_limits).get(args.model, NO_LIMITS)
        if args.max_concurrent is not None:
            given["max_concurrent"] = args.max_concurrent
        entry = NO_LIMITS if args.clear else changed(entry, **given)
        changes["model_limits"] = with_model_limits(key.model_limits, args.model, entry)
    else:
        if args.clear:
            raise CredentialError("--clear drops one model's limits: name it with --model")
        changes["limits"] = changed(key.limits, **given)
        if args.max_concurrent is not None:
            changes["max_concurrent"] = args.max_concurrent
        if args.models is not None:
            changes["models"] = tuple(dict.fromkeys(args.models))
    if args.weight is not None:
        changes["weight"] = args.weight
    if args.priority is not None:
        changes["priority"] = args.priority
    return dataclasses.replace(key, **changes)


def limits_json(key: ApiKey) -> dict[str, Any]:
    """A key's limits in ``key list --json`` (and every key command's JSON)."""
    return {
        "limits": key.limits.to_json(),
        "model_limits": {model: entry.to_json() for model, entry in key.model_limits},
        "weight": key.weight,
        "priority": key.priority,
    }


def show_limits(key: ApiKey) -> str:
    """A key's limits in one table cell: ``rpm=60 itpm=… budget=1000000/day; m: rpm=5``."""
    parts = [_show(key.limits) or "-"]
    parts += [f"{model}: {_show(entry)}" for model, entry in key.model_limits]
    return "; ".join(parts)


def _show(limits: KeyLimits) -> str:
    words = []
    for short, value in (
        ("rpm", limits.requests_per_minute),
        ("itpm", limits.input_tokens_per_minute),
        ("otpm", limits.output_tokens_per_minute),
        ("concurrent", limits.max_concurrent),
    ):
        if value:
            words.append(f"{short}={value}")
    if limits.token_budget:
        words.append(f"budget={limits.token_budget}/{limits.budget_period.value}")
    return " ".join(words)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    names: Sequence[str] = [dest for _, dest, _ in _FLAGS] + ["budget_period"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value
