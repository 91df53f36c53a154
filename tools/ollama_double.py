"""An Ollama-shaped provider double: Ollama's documented API and its load timing, no model.

Ollama cannot run on this machine (/work/shared/PROVIDERS.md), yet warm-aware scheduling
(docs/ARCHITECTURE.md#warm-aware-scheduling) is about what Ollama does with time: a
model's first request waits for a load, later ones answer at once, an idle model is
unloaded after ``keep_alive``, and a host that holds one model at a time unloads one to
load another. This server keeps exactly that:

- ``/api/chat`` and ``/api/generate`` (NDJSON stream by default, ``stream: false`` one
  object), with ``load_duration``, ``total_duration``, ``prompt_eval_count`` and
  ``eval_count`` in the final object; a generate with no prompt only loads the model
  (``done_reason: "load"``), and ``keep_alive: 0`` unloads it after the answer.
- ``/api/tags`` (installed models), ``/api/ps`` (loaded ones, with ``expires_at``),
  ``/api/version``.
- A load takes ``--load-s`` before the first token; concurrent requests of a loading
  model share its one load (as Ollama's scheduler does). ``--max-loaded N`` holds at most
  N models: loading another waits for the least recently used one's requests to end and
  unloads it. ``--keep-alive`` is the default ``keep_alive`` (Ollama's: 5m).
- ``GET /double/stats``: how many loads each model took (not Ollama's; for the tests and
  ``tools/hardening/warm_ttft.py``).

Run: ``python tools/ollama_double.py --port 0 --models m1,m2 --load-s 2`` prints
``ollama double listening on 127.0.0.1:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

SCRIPT = str(Path(__file__).resolve())
WARM_LOAD_NS = 2_000_000  # what a warm Ollama reports as load_duration: it checks the model
TOKENS = ("Hello", " from", " the", " double", ".")
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_s(value: Any, default: float) -> float:
    """Ollama's ``keep_alive``: seconds as a number, or a duration string ("5m", "30s");
    negative keeps the model loaded for ever, 0 unloads it after the request."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return float(value)
    found = _DURATION.match(str(value).strip())
    if found is None:
        raise ValueError(f"time: invalid duration {value!r}")
    return float(found.group(1)) * _UNITS[found.group(2)]


@dataclass
class Loaded:
    name: str
    expires: float  # loop time; inf: never
    running: int = 0
    last_used: float = 0.0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class Double:
    """The server's state: installed models, loaded ones, loads in progress."""

    def __init__(
        self,
        models: Sequence[str],
        load_s: float,
        max_loaded: int,
        keep_s: float,
        token_s: float = 0.0,
    ) -> None:
        self.models = tuple(models)
        self.load_s = load_s
        self.token_s = token_s  # generation time per token (0: at once)
        self.max_loaded = max_loaded
        self.keep_s = keep_s
        self.loaded: dict[str, Loaded] = {}
        self.loading: dict[str, asyncio.Future[None]] = {}
        self.loads: dict[str, int] = {}
        self._swap = asyncio.Lock()  # one load decision at a time

    async def acquire(self, name: str) -> int:
        """Have ``name`` loaded and count a request on it; the ns this request waited."""
        started = time.monotonic_ns()
        loop = asyncio.get_running_loop()
        while name not in self.loaded:
            pending = self.loading.get(name)
            if pending is not None:
                await asyncio.shield(pending)
                continue
            future: asyncio.Future[None] = loop.create_future()
            self.loading[name] = future
            try:
                async with self._swap:
                    await self._make_room()
                    await asyncio.sleep(self.load_s)  # reading the weights
                    self.loaded[name] = Loaded(name, loop.time() + self.keep_s)
                    self.loads[name] = self.loads.get(name, 0) + 1
            finally:
                del self.loading[name]
                future.set_result(None)
        entry = self.loaded[name]
        entry.running += 1
        entry.idle.clear()
        entry.last_used = loop.time()
        waited = time.monotonic_ns() - started
        return waited if waited > WARM_LOAD_NS else WARM_LOAD_NS

    def release(self, name: str, keep_s: float) -> None:
        entry = self.loaded.get(name)
        if entry is None:
            return
        entry.running -= 1
        now = asyncio.get_running_loop().time()
        entry.expires = now + keep_s if keep_s >= 0 else float("inf")
        entry.last_used = now
        if entry.running == 0:
            entry.idle.set()
            if keep_s == 0:
                del self.loaded[name]

    async def _make_room(self) -> None:
        """With ``max_loaded`` models in memory, the least recently used one goes once its
        requests end (Ollama waits for them too)."""
        while self.max_loaded and len(self.loaded) >= self.max_loaded:
            victim = min(self.loaded.values(), key=lambda e: e.last_used)
            if victim.running:
                await victim.idle.wait()
                continue
            del self.loaded[victim.name]

    def reap(self) -> None:
        now = asyncio.get_running_loop().time()
        for name, entry in list(self.loaded.items()):
            if entry.running == 0 and entry.expires <= now:
                del self.loaded[name]

    def ps(self) -> list[dict[str, Any]]:
        now, wall = asyncio.get_running_loop().time(), time.time()
        rows = []
        for entry in self.loaded.values():
            left = entry.expires - now
            expires = wall + (left if left < 10**9 else 10**9)
            rows.append(
                {
                    "name": entry.name,
                    "model": entry.name,
                    "size": 1 << 20,
                    "digest": "0" * 64,
                    "expires_at": datetime.fromtimestamp(expires, UTC).isoformat(),
                    "size_vram": 0,
                }
            )
        return rows


def _final(model: str, chat: bool, load_ns: int, total_ns: int, prompt: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "created_at": datetime.now(UTC).isoformat(),
        "done": True,
        "done_reason": "stop",
        "total_duration": total_ns,
        "load_duration": load_ns,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": 1_000_000,
        "eval_count": len(TOKENS),
        "eval_duration": 1_000_000,
    }
    body["message" if chat else "response"] = {"role": "assistant", "content": ""} if chat else ""
    return body


def _piece(model: str, chat: bool, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "created_at": datetime.now(UTC).isoformat()}
    body["message" if chat else "response"] = (
        {"role": "assistant", "content": text} if chat else text
    )
    body["done"] = False
    return body


def build_app(double: Double) -> web.Application:
    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.12.6"})

    async def tags(_: web.Request) -> web.Response:
        return web.json_response(
            {"models": [{"name": m, "model": m, "size": 1 << 20} for m in double.models]}
        )

    async def ps(_: web.Request) -> web.Response:
        return web.json_response({"models": double.ps()})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"loads": double.loads, "loaded": sorted(double.loaded)})

    async def answer(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat")
        body = await request.json()
        model = str(body.get("model") or "")
        if model not in double.models:
            return web.json_response({"error": f"model '{model}' not found"}, status=404)
        try:
            keep_s = keep_alive_s(body.get("keep_alive"), double.keep_s)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        started = time.monotonic_ns()
        load_ns = await double.acquire(model)
        try:
            turns = body.get("messages") if chat else body.get("prompt")
            prompt = len(json.dumps(turns or "")) // 4 + 1
            if not turns:  # a load (or an unload, keep_alive 0) and nothing else
                final = _final(model, chat, load_ns, time.monotonic_ns() - started, 0)
                final["done_reason"] = "unload" if keep_s == 0 else "load"
                final["eval_count"] = 0
                return web.json_response(final)
            if body.get("stream", True) is False:
                final = _final(model, chat, load_ns, time.monotonic_ns() - started, prompt)
                text = "".join(TOKENS)
                if chat:
                    final["message"]["content"] = text
                else:
                    final["response"] = text
                await asyncio.sleep(double.token_s * len(TOKENS))
                return web.json_response(final)
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            for token in TOKENS:
                if double.token_s:
                    await asyncio.sleep(double.token_s)
                await response.write(json.dumps(_piece(model, chat, token)).encode() + b"\n")
            final = _final(model, chat, load_ns, time.monotonic_ns() - started, prompt)
            await response.write(json.dumps(final).encode() + b"\n")
            await response.write_eof()
            return response
        finally:
            double.release(model, keep_s)

    app = web.Application()
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/double/stats", stats)
    app.router.add_post("/api/chat", answer)
    app.router.add_post("/api/generate", answer)
    return app


async def serve(args: argparse.Namespace) -> None:
    models = [m for m in args.models.split(",") if m]
    keep_s = keep_alive_s(args.keep_alive, 300)
    double = Double(models, args.load_s, args.max_loaded, keep_s, args.token_s)
    runner = web.AppRunner(build_app(double), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"ollama double listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        while not stop.is_set():
            double.reap()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def spawned(*options: str) -> AsyncIterator[str]:
    """This double in a process of its own (``options``: its command line); yields its base
    URL once it serves, and stops it on the way out."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, SCRIPT, "--port", "0", *options,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        if "listening on" not in line:
            raise RuntimeError(f"the ollama double did not start: {line!r}")
        yield f"http://{line.rsplit(' ', 1)[1].strip()}"
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), 10)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--models", default="smollm2:135m")
    parser.add_argument("--load-s", type=float, default=1.5, help="a load's time")
    parser.add_argument("--max-loaded", type=int, default=0, help="0: no limit")
    parser.add_argument("--keep-alive", default="5m", help="the default keep_alive")
    parser.add_argument("--token-s", type=float, default=0.0, help="time per token")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
