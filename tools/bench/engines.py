"""Several llama.cpp engines side by side, each knowing who it is, with their own counters.

The agents scenario needs engines that a router can choose between and that tell,
after the fact, what each choice cost. Each engine is ``tools/llama_server.py``
(SmolLM2-135M, one slot, one thread, the prompt cache on, as llama.cpp ships it)
in a process of its own, with:

- a distinct ``--alias`` (``agent-e0``, ``agent-e1``, ...): llama.cpp answers with its
  alias in every chunk's ``model`` whatever the request named, and a router relays
  the chunks unchanged, so the answer says which engine served it (smg sends a model
  only to workers that list it, so for smg they share one alias and smg's own
  ``x-smg-routed-worker-id`` header names the engine);
- ``/metrics`` on: ``llamacpp:prompt_tokens_total`` (prompt tokens evaluated) and
  ``llamacpp:prompt_tokens_cached_total`` (served from the slot's cache), read
  before and after a target's run, are the engines' own account of the prefill work.

A fresh set per target: llama.cpp keeps a slot's KV cache and, beside it, saved
prompt states in RAM (``cache_ram``); erasing a slot (``/slots/0?action=erase``)
needs ``--slot-save-path`` and leaves the RAM cache, so a restart is the one sure way
that no target starts on another's warm cache. The start time is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

from iop_proto.testing import port_taken, ports_to_try

from .procs import spawn

LAUNCHER: Final = Path(__file__).resolve().parent.parent / "llama_server.py"
ALIAS_PREFIX: Final = "agent-e"
COUNTERS: Final = {
    "prompt_tokens": "llamacpp:prompt_tokens_total",
    "cached_tokens": "llamacpp:prompt_tokens_cached_total",
    "prompt_seconds": "llamacpp:prompt_seconds_total",
    "predicted_tokens": "llamacpp:tokens_predicted_total",
}
START_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True)
class EngineSettings:
    count: int = 3
    ctx: int = 8192
    threads: int = 1


@dataclass(frozen=True)
class Engine:
    index: int
    url: str  # without /v1
    pid: int
    alias: str


def engine_of(model: str) -> int | None:
    """The engine index an answer's ``model`` names (``agent-e2`` -> 2), or ``None``."""
    if model.startswith(ALIAS_PREFIX) and model[len(ALIAS_PREFIX) :].isdigit():
        return int(model[len(ALIAS_PREFIX) :])
    return None


@dataclass
class EngineSet:
    engines: list[Engine]
    start_s: float  # from the first spawn to every engine serving

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    async def counters(self) -> list[dict[str, float]]:
        """Each engine's counters (``COUNTERS``' keys) from its ``/metrics``."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            return [await _read_counters(http, engine.url) for engine in self.engines]


async def _read_counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"{url}/metrics: HTTP {response.status}: {text[:200]}")
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for key, metric in COUNTERS.items():
            if name == metric:
                values[key] = float(value)
    return values


def delta(after: list[dict[str, float]], before: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]


@contextlib.asynccontextmanager
async def start_engines(
    root: Path, settings: EngineSettings, shared_alias: str | None = None
) -> AsyncIterator[EngineSet]:
    """``settings.count`` fresh engines on ephemeral ports, all serving (``/health`` 200).

    ``shared_alias``: one model name for all, for a router that sends a model only to the
    workers listing it (smg); the answer's ``model`` then names no engine.
    """
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as exits:
        # One after the other: a failed start leaves only started engines to stop.
        engines = [
            await exits.enter_async_context(
                _engine(root, i, settings, shared_alias or f"{ALIAS_PREFIX}{i}")
            )
            for i in range(settings.count)
        ]
        yield EngineSet(engines, time.monotonic() - started)


@contextlib.asynccontextmanager
async def _engine(
    root: Path, index: int, settings: EngineSettings, alias: str
) -> AsyncIterator[Engine]:
    """One engine on a port chosen here: llama.cpp's log shares the pipe with the ready
    line and can split it mid-URL, so the URL is never read back from the output."""
    for port in ports_to_try():
        argv = [
            sys.executable,
            str(LAUNCHER),
            *("--port", str(port), "--alias", alias, "--metrics"),
            *("--ctx", str(settings.ctx), "--threads", str(settings.threads), "--parallel", "1"),
        ]
        attempt = contextlib.AsyncExitStack()
        try:
            # llama_server.py polls /health itself: ready means requests are served.
            child = await attempt.enter_async_context(
                spawn(
                    argv,
                    ready=re.compile(r"ready: llamacpp"),
                    log=root / f"engine-{index}.log",
                    timeout_s=START_TIMEOUT_S,
                )
            )
        except BaseException as exc:
            await attempt.aclose()
            if isinstance(exc, RuntimeError) and port_taken(port):
                continue  # another process bound the port first
            raise
        async with attempt:
            yield Engine(index, f"http://127.0.0.1:{port}", child.pid, alias)
        return
    raise RuntimeError(f"engine {index}: no free port")
