"""Stored responses grow with what clients send, not with the square of a conversation.

Against the real stack (control-plane, edge, two nodes, a worker; real mTLS, the
edge's real SQLite file), measuring ``edge-responses.db`` (with its WAL) on disk:

- a conversation of 300 chained turns (``previous_response_id`` = the last
  answer) stores each turn once;
- the branch attack: a chain of 14 turns of 1 MiB each, then 20 requests of a
  few bytes (``"input": "hi"``) that each continue its last turn, adds 20 small
  rows, not 20 copies of the 14 MiB conversation.

The bound is generous: twice what the clients sent, plus a fixed allowance for
the WAL and 8 KiB per stored turn (its Response object, ids, SQLite's pages). On
the code before this, each turn kept the whole conversation it answered: 300
turns took tens of MB, and the branch attack 300 MB (105 MiB for the chain alone).
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
MODEL = "mock-small"
MiB = 1024 * 1024
TURNS = 300
TURN_TEXT = 512  # bytes of input per turn of the long conversation
CHAIN = 14
BRANCHES = 20
PER_ROW = 8 * 1024
WAL_ALLOWANCE = 8 * MiB  # checkpoints every 1,000 pages; the file keeps its largest size
TIMEOUT = aiohttp.ClientTimeout(total=120)


def report(text: str) -> None:
    print(f"\n[response storage] {text}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        yield session


def files(stack: Stack) -> tuple[Path, Path]:
    path: Path = stack.root / "edge-responses.db"
    return path, path.with_name(path.name + "-wal")


def stored_bytes(stack: Stack) -> int:
    """The response store on disk: the database file and its write-ahead log."""
    return sum(p.stat().st_size for p in files(stack) if p.exists())


def on_disk(stack: Stack) -> str:
    database, wal = (p.stat().st_size / MiB if p.exists() else 0.0 for p in files(stack))
    return f"edge-responses.db {database:.2f} MiB, -wal {wal:.2f} MiB"


async def respond(
    http: aiohttp.ClientSession, stack: Stack, text: str, previous: str | None
) -> str:
    body: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 4}
    if previous is not None:
        body["previous_response_id"] = previous
    data = io.BytesIO(json.dumps(body).encode())  # a 1 MiB body: streamed, not one write
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{stack.api_url}/responses", data=data, headers=headers) as reply:
        payload = await reply.json()
        assert reply.status == 200, payload
        return str(payload["id"])


async def chain(
    http: aiohttp.ClientSession, stack: Stack, texts: list[str]
) -> tuple[str | None, int]:
    """One stored turn per text, each continuing the one before: the last turn's id and
    the bytes sent."""
    tip: str | None = None
    for text in texts:
        tip = await respond(http, stack, text, tip)
    return tip, sum(len(text) for text in texts)


def bound(sent: int, rows: int) -> int:
    return 2 * sent + WAL_ALLOWANCE + PER_ROW * rows


async def test_a_300_turn_conversation_stores_each_turn_once(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    before = stored_bytes(stack)
    texts = [f"turn {turn} ".ljust(TURN_TEXT, "x") for turn in range(TURNS)]
    previous, sent = await chain(http, stack, texts)
    grown = stored_bytes(stack) - before
    report(
        f"{TURNS} chained turns of {TURN_TEXT} bytes: the store grew by {grown / MiB:.2f} MiB"
        f" ({grown / sent:.1f} bytes per byte sent; bound {bound(sent, TURNS) / MiB:.2f} MiB;"
        f" {on_disk(stack)})"
    )
    assert grown < bound(sent, TURNS)
    # The whole conversation is still what its last turn continues.
    async with http.get(f"{stack.api_url}/responses/{previous}/input_items?limit=100") as reply:
        page = await reply.json()
    assert reply.status == 200, page
    assert page["has_more"] is True  # 300 inputs and 299 answers before its own input
    assert page["data"][0]["content"][0]["text"].startswith(f"turn {TURNS - 1} ")


async def test_branches_off_a_long_chain_store_only_what_they_add(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    before = stored_bytes(stack)
    tip, sent = await chain(http, stack, [f"part {turn} ".ljust(MiB, "y") for turn in range(CHAIN)])
    chain_bytes = stored_bytes(stack) - before
    for _ in range(BRANCHES):
        sent += len("hi")
        await respond(http, stack, "hi", tip)
    grown = stored_bytes(stack) - before
    rows = CHAIN + BRANCHES
    report(
        f"chain of {CHAIN} x 1 MiB: the store grew by {chain_bytes / MiB:.1f} MiB; after"
        f" {BRANCHES} branches of 'hi' off its tip: {grown / MiB:.1f} MiB in all"
        f" (bound {bound(sent, rows) / MiB:.1f} MiB; {on_disk(stack)})"
    )
    assert grown < bound(sent, rows)
