"""The last section's client side: the key the guide issues, the load a client on host 3
sends through host 4's HAProxy, and what HAProxy's connection log says of each
connection (which edge carried it, what came back)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guide import Guide

MODEL, PROVIDER = "smollm2:135m", "node-a-llamacpp"
LOAD_CLIENT = Path(__file__).with_name("load_client.py")
# Four at a time: both edges busy on node-a's one llama.cpp slot and its queue, which
# (16 by default) takes them all: no 429 from the test's own load. Some 20 s here.
LOAD_TOTAL, LOAD_CONCURRENCY = 80, 4


def issued_key(printed: str) -> str:
    """The key `key issue` printed, the line after its "Issued API key" line."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Issued API key"))
    return next(line.strip() for line in lines[start + 1 :] if line.strip())


@dataclass(frozen=True)
class Connection:
    """One client connection as HAProxy logged it when it ended (``option tcplog``)."""

    edge: str  # the server that carried it
    answered_bytes: int  # what the edge sent back: 0 for one cut before any answer
    redispatched: bool  # "+" on its retries: refused by one edge, carried by the other


# "api edges/edge-1 1/0/267 901 -- 5/5/4/2/+1 0/0": timers, bytes, state, counts/retries
_TCPLOG = re.compile(r" edges/(edge-\d) [-\d]+/[-\d]+/[-\d]+ (\d+) \S+ (?:[-\d]+/){4}(\+?)\d+ ")


def connections(haproxy_log: str) -> list[Connection]:
    return [
        Connection(edge, int(answered), bool(plus))
        for edge, answered, plus in _TCPLOG.findall(haproxy_log)
    ]


async def load(
    guide: Guide, key: str, on_progress: Callable[[int], Awaitable[None]]
) -> list[dict[str, Any]]:
    """``load_client.py`` on host 3 through host 4's balancer; ``on_progress(ended)`` is
    awaited after each request ends; every request's line."""
    url = f"http://{guide.network.host(4).address}:8080/v1"
    argv = (url, key, MODEL, str(LOAD_TOTAL), str(LOAD_CONCURRENCY))
    process = await asyncio.create_subprocess_exec(
        *guide.network.host(3).wrapper,
        *(sys.executable, str(LOAD_CLIENT), *argv),
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    ended: list[dict[str, Any]] = []
    async with asyncio.timeout(240):
        while line := await process.stdout.readline():
            ended.append(json.loads(line))
            await on_progress(len(ended))
        assert await process.wait() == 0
    return ended
