"""The rate-limit headers of a limited key's answers, as OpenAI and Anthropic send them.

OpenAI (``x-ratelimit-*``): ``limit``, ``remaining`` and ``reset`` of ``requests`` and
``tokens``, the reset a duration (``1s``, ``6m0s``, ``20ms``). Anthropic
(``anthropic-ratelimit-*``): the same of ``requests``, ``input-tokens``,
``output-tokens`` and ``tokens``, the reset an RFC 3339 time. Each value is the
limiter's standing after the request was admitted (``key_rates.Gauge``): ``remaining``
what is left now, ``reset`` when the bucket is full again. OpenAI has one token limit
and Anthropic's ``tokens`` is "the most restrictive limit in effect": both show the
token bucket with less left. A key's budget, which neither API has, is shown as
``x-iop-budget-limit``, ``-remaining`` and ``-reset`` (RFC 3339, the period's end).
A key without limits gets none of them: there is nothing to report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final

from iop_edge.domain.key_rates import BUDGET, INPUT, OUTPUT, REQUESTS, Gauge

BUDGET_PREFIX: Final = "x-iop-budget-"


def duration(seconds: float) -> str:
    """OpenAI's reset duration: ``20ms`` below a second, else ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes >= 1:
        return f"{int(minutes)}m{text}"
    return text


def rfc3339(seconds_from_now: float, now: float | None = None) -> str:
    moment = (time.time() if now is None else now) + max(0.0, seconds_from_now)
    return datetime.fromtimestamp(round(moment), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tightest(gauges: Sequence[Gauge]) -> Gauge | None:
    tokens = [g for g in gauges if g.kind in (INPUT, OUTPUT)]
    return min(tokens, key=lambda g: g.remaining) if tokens else None


def openai_headers(gauges: Sequence[Gauge]) -> dict[str, str]:
    headers: dict[str, str] = {}
    shown = [(g, "requests") for g in gauges if g.kind == REQUESTS]
    tokens = _tightest(gauges)
    if tokens is not None:
        shown.append((tokens, "tokens"))
    for gauge, name in shown:
        headers[f"x-ratelimit-limit-{name}"] = str(gauge.limit)
        headers[f"x-ratelimit-remaining-{name}"] = str(gauge.remaining)
        headers[f"x-ratelimit-reset-{name}"] = duration(gauge.reset_s)
    headers.update(_budget(gauges))
    return headers


_ANTHROPIC: Final = {REQUESTS: "requests", INPUT: "input-tokens", OUTPUT: "output-tokens"}


def anthropic_headers(gauges: Sequence[Gauge], now: float | None = None) -> dict[str, str]:
    headers: dict[str, str] = {}
    shown = [(g, _ANTHROPIC[g.kind]) for g in gauges if g.kind in _ANTHROPIC]
    tokens = _tightest(gauges)
    if tokens is not None:
        shown.append((tokens, "tokens"))
    for gauge, name in shown:
        headers[f"anthropic-ratelimit-{name}-limit"] = str(gauge.limit)
        headers[f"anthropic-ratelimit-{name}-remaining"] = str(gauge.remaining)
        headers[f"anthropic-ratelimit-{name}-reset"] = rfc3339(gauge.reset_s, now)
    headers.update(_budget(gauges, now))
    return headers


def _budget(gauges: Sequence[Gauge], now: float | None = None) -> dict[str, str]:
    for gauge in gauges:
        if gauge.kind == BUDGET:
            return {
                BUDGET_PREFIX + "limit": str(gauge.limit),
                BUDGET_PREFIX + "remaining": str(gauge.remaining),
                BUDGET_PREFIX + "reset": rfc3339(gauge.reset_s, now),
            }
    return {}
