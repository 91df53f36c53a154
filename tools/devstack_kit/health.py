"""Readiness and availability, polled: a health URL, and every provider in the catalog."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping

import aiohttp

AVAILABLE = "available"
POLL_INTERVAL_S = 0.1


async def poll_health(session: aiohttp.ClientSession, url: str) -> None:
    """Return once ``url`` answers 200: the readiness signal for a child that logs no line."""
    timeout = aiohttp.ClientTimeout(total=1.0)
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with session.get(url, timeout=timeout) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(POLL_INTERVAL_S)


# The edge's admin port (loopback, no API key) publishes each provider's health as
# `iop_edge_provider_health{provider="...",state="available"} 1.0`.
HEALTH_SAMPLE = re.compile(
    r'^iop_edge_provider_health\{(?=[^}]*provider="(?P<provider>[^"]+)")'
    r'(?=[^}]*state="(?P<state>[^"]+)")[^}]*\} 1(?:\.0)?$',
    re.MULTILINE,
)


async def poll_providers(
    session: aiohttp.ClientSession,
    url: str,
    expected: frozenset[str],
    seen: dict[str, str],
    metrics_url: str | None = None,
) -> int:
    """Return how many providers the catalog lists once all of them, and ``expected``, are
    available. ``seen`` keeps the last answer (provider id -> health) for error messages.

    ``expected`` matters because a node's providers appear only once the node registers:
    a catalog without them is not a catalog of available providers. Once API keys exist
    the catalog answers 401 to a caller without one (this script has none): then the
    providers' health is read from the edge's admin ``metrics_url`` instead.
    """
    timeout = aiohttp.ClientTimeout(total=2.0)
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with session.get(url, timeout=timeout) as response:
                if response.status == 200:
                    rows = (await response.json())["data"]
                    seen.clear()
                    seen.update({str(r["provider_id"]): str(r["health"]) for r in rows})
                elif response.status == 401 and metrics_url is not None:
                    async with session.get(metrics_url, timeout=timeout) as metrics:
                        text = await metrics.text()
                    seen.clear()
                    seen.update((m["provider"], m["state"]) for m in HEALTH_SAMPLE.finditer(text))
        if seen and expected <= seen.keys() and set(seen.values()) == {AVAILABLE}:
            return len(seen)
        await asyncio.sleep(POLL_INTERVAL_S)


def describe_providers(expected: frozenset[str], seen: Mapping[str, str]) -> str:
    missing = [f"{pid} (not in the catalog)" for pid in sorted(expected - seen.keys())]
    other = [f"{pid} ({health})" for pid, health in sorted(seen.items()) if health != AVAILABLE]
    return ", ".join(missing + other) or "none listed"
