"""The agents scenario's load: coding-agent sessions, and the same load with nothing shared.

An agent session is one long conversation: a system prompt of its own (hundreds of
tokens), then turns, each sending the whole conversation so far (every earlier
answer and user message) plus a new user message. An engine that served the
previous turn holds all of it but the new tail in its cache; any other engine
evaluates the whole prompt again. The ``no_prefix`` load sends the same number of
requests of the same sizes, each made of fresh text, so no engine can reuse
anything: what a router's choices cost when there is nothing to gain.

Text is seeded words from a list of common English words, each one token for
SmolLM2's tokenizer with its leading space (checked with llama.cpp's
``/tokenize``: 400 words, 400 tokens), so sizes are exact and every run sends the
same text. Answers are the model's own (temperature 0), as an agent's would be.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from .client import RequestFailed

WORDS: Final = (
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
    "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
    "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there",
    "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other",
    "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make",
    "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number",
    "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who",
    "oil", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may",
    "part",
)  # fmt: skip
SESSION_HEADERS: Final = ("x-session-id", "x-smg-routing-key")  # agents'; smg's and sglang's
WORKER_HEADER: Final = "x-smg-routed-worker-id"  # smg: the URL of the worker it chose
TIMEOUT: Final = aiohttp.ClientTimeout(total=300, sock_connect=10)


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: int
    concurrency: int  # sessions in flight at once
    system_tokens: int
    user_tokens: int
    max_tokens: int  # of each answer


@dataclass(frozen=True)
class Route:
    """How a target is reached: one base URL for every session, or (the oracle) session
    ``i`` sent to ``base_urls[i % n]``."""

    base_urls: tuple[str, ...]  # each ends in /v1
    model: str
    session_header: bool  # send the session's id in SESSION_HEADERS

    def chat_url(self, session: int) -> str:
        return f"{self.base_urls[session % len(self.base_urls)]}/chat/completions"


@dataclass
class Turn:
    """One request's outcome as the client saw it."""

    session: int
    turn: int
    ttft_s: float
    total_s: float
    model: str  # the answer's ``model``: a llama.cpp engine's alias, when relayed unchanged
    answer_id: str  # the answer's ``id`` (IOP's names its run: chatcmpl-<run id>)
    worker: str  # smg's ``x-smg-routed-worker-id`` header (the engine's URL), or ""
    engine: int | None = None  # which engine served it, once known


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompt(session: int, tokens: int, salt: str = "agent") -> str:
    rng = random.Random(f"{salt}-system-{session}")
    return f"You are coding agent {session}. " + words(rng, tokens)


def user_message(session: int, turn: int, tokens: int, salt: str = "agent") -> str:
    return words(random.Random(f"{salt}-user-{session}-{turn}"), tokens)


def fresh_conversation(session: int, turn: int, load: Workload) -> list[dict[str, str]]:
    """The no-prefix request of (session, turn): an agent turn's shape, all text new."""
    salt = f"fresh-{session}-{turn}"
    messages = [{"role": "system", "content": system_prompt(session, load.system_tokens, salt)}]
    rng = random.Random(f"{salt}-answers")
    for earlier in range(turn):
        messages.append(
            {"role": "user", "content": user_message(session, earlier, load.user_tokens, salt)}
        )
        messages.append({"role": "assistant", "content": words(rng, load.max_tokens)})
    messages.append(
        {"role": "user", "content": user_message(session, turn, load.user_tokens, salt)}
    )
    return messages


async def chat_turn(
    http: aiohttp.ClientSession,
    route: Route,
    session: int,
    turn: int,
    messages: list[dict[str, str]],
    max_tokens: int,
) -> tuple[Turn, str]:
    """One streamed chat completion: its timing and identity, and the answer's text."""
    headers = {"Authorization": "Bearer sk-bench"}
    if route.session_header:
        headers.update(dict.fromkeys(SESSION_HEADERS, f"agent-session-{session}"))
    body: dict[str, Any] = {
        "model": route.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    clock = time.perf_counter
    started = clock()
    ttft = float("nan")
    model = answer_id = ""
    parts: list[str] = []
    async with http.post(route.chat_url(session), json=body, headers=headers) as response:
        if response.status != 200:
            text = await response.read()
            raise RequestFailed(f"HTTP {response.status}: {text[:300]!r}")
        worker = response.headers.get(WORKER_HEADER, "")
        async for line in response.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[len(b"data:") :])
            model = model or str(chunk.get("model", ""))
            answer_id = answer_id or str(chunk.get("id", ""))
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if not parts:
                        ttft = clock() - started
                    parts.append(content)
    if not parts:
        raise RequestFailed(f"session {session} turn {turn}: no content")
    return Turn(session, turn, ttft, clock() - started, model, answer_id, worker), "".join(parts)


async def run_load(route: Route, load: Workload, shared_prefix: bool) -> tuple[list[Turn], float]:
    """Every session's turns (``load.concurrency`` sessions at once); (turns, wall seconds)."""
    turns: list[Turn] = []
    gate = asyncio.Semaphore(load.concurrency)
    connector = aiohttp.TCPConnector(limit=load.concurrency, force_close=True)

    async def agent(http: aiohttp.ClientSession, session: int) -> None:
        system = system_prompt(session, load.system_tokens)
        messages = [{"role": "system", "content": system}]
        async with gate:
            for turn in range(load.turns):
                if shared_prefix:
                    user = user_message(session, turn, load.user_tokens)
                    messages.append({"role": "user", "content": user})
                    sent = messages
                else:
                    sent = fresh_conversation(session, turn, load)
                outcome, answer = await chat_turn(http, route, session, turn, sent, load.max_tokens)
                turns.append(outcome)
                messages.append({"role": "assistant", "content": answer})

    started = time.perf_counter()
    # force_close: llama.cpp drops idle keep-alive connections on its own schedule.
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as http:
        async with asyncio.TaskGroup() as group:
            for session in range(load.sessions):
                group.create_task(agent(http, session))
    return turns, time.perf_counter() - started


def same_engine_share(turns: list[Turn]) -> float | None:
    """Of the turns after a session's first, the share served by the engine that served
    the session's previous turn (``None`` where an engine is unknown)."""
    by_session: dict[int, dict[int, int | None]] = {}
    for t in turns:
        by_session.setdefault(t.session, {})[t.turn] = t.engine
    pairs = [
        (engines[n - 1], engines[n])
        for engines in by_session.values()
        for n in sorted(engines)
        if n - 1 in engines
    ]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    return sum(a == b for a, b in pairs) / len(pairs)


def attribute(turns: list[Turn], engine_of: Callable[[Turn], int | None]) -> None:
    for t in turns:
        t.engine = engine_of(t)
