"""A fake OpenAI-compatible backend: the fixed point every gateway is measured against.

It answers ``/v1/chat/completions`` at once (or after a delay) and streams N chunks
at a set rate, doing as little work as it can, so that the time a gateway adds is
not hidden behind the backend's own. Behaviour comes from the command line and can
be chosen per request through the model name, which every gateway passes on
unchanged (a vendor field in the body might be dropped by some):

- ``fake``          the defaults (``--delay-ms``, ``--rate``);
- ``fake-d5``       wait 5 ms before answering (before the first chunk of a stream);
- ``fake-r200``     stream at 200 chunks/s (``r0``: as fast as the socket takes them).

A stream has ``max_tokens`` content chunks (each ``"x "``), then a finish chunk, a
usage chunk when ``stream_options.include_usage`` asks for one, and ``[DONE]``.

It counts the requests it is answering at once, as an engine's own gauge would:
``GET /stats`` gives the count now, its peak and its time integral since the last
``POST /stats/reset`` (the mean concurrency over a window is the integral's growth
over the window's length); tools/hardening/limits_sustained.py reads them.

Run: ``python tools/bench/fake_backend.py [--port 0]``; it prints
``fake backend on http://127.0.0.1:PORT`` when it listens, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

try:  # orjson and uvloop are optional: the fake must not be the slow part, but runs without
    import orjson

    def _dumps(value: Any) -> bytes:
        return orjson.dumps(value)

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment

    def _dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    _loads = json.loads

DEFAULT_TOKENS: Final = 16
MAX_TOKENS: Final = 100_000
_MODEL = re.compile(r"^(?P<base>[a-z0-9_.:]+?)(?:-d(?P<delay>\d+))?(?:-r(?P<rate>\d+))?$")
_DONE: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How one request is answered."""

    delay_s: float = 0.0
    rate: float = 0.0  # chunks per second; 0 = no pacing

    def for_model(self, model: str) -> Behaviour:
        """The model name's suffixes (``-d<ms>``, ``-r<rate>``) override the defaults."""
        match = _MODEL.match(model)
        if match is None:
            return self
        delay, rate = match.group("delay"), match.group("rate")
        return Behaviour(
            delay_s=int(delay) / 1000 if delay is not None else self.delay_s,
            rate=float(rate) if rate is not None else self.rate,
        )


class Concurrency:
    """Requests being answered at once: now, the peak and the time integral since ``reset``.

    Every change first adds ``now x elapsed`` to the integral, so the integral is exact
    (not sampled): a request of one millisecond counts as much as it lasted.
    """

    __slots__ = ("_changed", "integral", "now", "peak", "since")

    def __init__(self) -> None:
        self.now = 0
        self.reset()

    def reset(self) -> None:
        self.since = self._changed = time.monotonic()
        self.integral = 0.0
        self.peak = self.now

    def _settle(self) -> None:
        at = time.monotonic()
        self.integral += self.now * (at - self._changed)
        self._changed = at

    def enter(self) -> None:
        self._settle()
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self._settle()
        self.now -= 1

    def stats(self) -> dict[str, float]:
        self._settle()
        return {
            "now": self.now,
            "peak": self.peak,
            "integral": self.integral,
            "seconds": self._changed - self.since,
            "clock": self._changed,
        }


class FakeBackend:
    """The handlers; one instance per server."""

    def __init__(self, defaults: Behaviour, models: tuple[str, ...]) -> None:
        self._defaults = defaults
        self.concurrency = Concurrency()
        self._models = _dumps(
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "owned_by": "bench"} for m in models],
            }
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/stats/reset", self.reset)
        return app

    async def stats(self, request: web.Request) -> web.Response:
        return web.Response(body=_dumps(self.concurrency.stats()), content_type="application/json")

    async def reset(self, request: web.Request) -> web.Response:
        self.concurrency.reset()
        return await self.stats(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=self._models, content_type="application/json")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.concurrency.enter()
        try:
            return await self._chat(request)
        finally:
            self.concurrency.leave()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = _loads(await request.read())
        model = str(body.get("model") or "fake")
        behaviour = self._defaults.for_model(model)
        # sglang-router forwards max_tokens as OpenAI's newer max_completion_tokens
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_TOKENS
        tokens = max(1, min(int(asked), MAX_TOKENS))
        if behaviour.delay_s > 0:
            await asyncio.sleep(behaviour.delay_s)
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await self._stream(request, model, tokens, behaviour.rate, usage)
        return web.Response(body=_completion(model, tokens), content_type="application/json")

    async def _stream(
        self, request: web.Request, model: str, tokens: int, rate: float, usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        head = _chunk(model, {"role": "assistant", "content": "x "}, None)
        chunk = _chunk(model, {"content": "x "}, None)
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(tokens):
            if rate > 0 and i > 0:
                # An absolute schedule: a late wake-up does not shift every later chunk.
                pause = started + i / rate - loop.time()
                if pause > 0:
                    await asyncio.sleep(pause)
            await response.write(head if i == 0 else chunk)
        tail = _chunk(model, {}, "length")
        if usage:
            tail += b"data: " + _dumps(_usage_chunk(model, tokens)) + b"\n\n"
        await response.write(tail + _DONE)
        await response.write_eof()
        return response


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}


def _completion(model: str, tokens: int) -> bytes:
    return _dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x " * tokens},
                    "finish_reason": "length",
                }
            ],
            "usage": _usage(tokens),
        }
    )


def _chunk(model: str, delta: dict[str, str], finish: str | None) -> bytes:
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + _dumps(payload) + b"\n\n"


def _usage_chunk(model: str, tokens: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": _usage(tokens),
    }


@contextlib.asynccontextmanager
async def serving(
    defaults: Behaviour, models: tuple[str, ...], port: int = 0
) -> AsyncIterator[int]:
    """Serve on 127.0.0.1 (``port`` 0: a free one); yields the port."""
    # handler_cancellation: a request whose client went away ends here too, as it does in
    # a real engine (vLLM aborts it): the concurrency it counts is what is still wanted.
    runner = web.AppRunner(
        FakeBackend(defaults, models).app(), access_log=None, handler_cancellation=True
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _main(args: argparse.Namespace) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stopping.set)
    defaults = Behaviour(delay_s=args.delay_ms / 1000, rate=args.rate)
    async with serving(defaults, tuple(args.models), args.port) as port:
        print(f"fake backend on http://127.0.0.1:{port}", flush=True)
        await stopping.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="wait before answering")
    parser.add_argument("--rate", type=float, default=0.0, help="stream chunks/s (0: no pacing)")
    parser.add_argument(
        "--models", nargs="+", default=["fake"], help="names /v1/models lists (any name works)"
    )
    args = parser.parse_args()
    run = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    run(_main(args))


if __name__ == "__main__":
    main()
