"""The node's provider HTTP client in isolation: CPU per request, aiohttp against httptools.

    tools/hardening/provider_client.py [--requests 4000] [--concurrency 1 16]

One fake backend (``tools/bench/fake_backend.py``, its own process) answers
non-streamed chat completions; this process posts the node's kind of request
(a JSON body of a few hundred bytes, ``Content-Type`` and keep-alive) and reads
each answer whole, on uvloop, and reports this process's CPU per request (the
server's is not counted) and the requests per second, for:

- ``aiohttp``: the node's client today: one ``ClientSession`` (the node's timeout),
  ``post`` with ``raise_for_status=False``, the body read chunk by chunk under a
  limit as ``adapters/answer_read.py`` does it, then ``release()``;
- ``aiohttp-tuned``: the same without a cookie jar and with the URL parsed once
  (what settings alone could give);
- ``httptools``: the floor of a client on a kept library's parser: an asyncio
  protocol per connection, a keep-alive pool, the request written as one buffer,
  the answer parsed by ``httptools.HttpResponseParser`` (llhttp). No timeouts, no
  limits, no TLS, no redirects: what a client built that way could not go below;
- ``provider_http``: the node's client built that way
  (``iop_node.adapters.provider_http``, where the checkout has it), its answer read
  by ``adapters/answer_read.py``.
Those two are skipped when ``httptools`` is not importable.

Variants alternate in rounds so that a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backends import fake_backend

BODY = json.dumps(
    {
        "model": "fake",
        "messages": [{"role": "user", "content": "Say hello in one short sentence, please."}],
        "max_tokens": 8,
        "stream": False,
    }
).encode()
LIMIT = 16 * 1024 * 1024


class AiohttpClient:
    def __init__(self, url: str) -> None:
        self._url = url + "/v1/chat/completions"
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        self._headers = {"Content-Type": "application/json"}

    async def post(self) -> bytes:
        response = await self._http.post(
            self._url, data=BODY, headers=self._headers, raise_for_status=False
        )
        try:
            if response.content_length is not None and response.content_length > LIMIT:
                raise RuntimeError("too large")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
                if size > LIMIT:
                    raise RuntimeError("too large")
                chunks.append(chunk)
        except BaseException:
            response.close()
            raise
        response.release()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aclose(self) -> None:
        await self._http.close()


class NodeClient:
    """The node's client (``iop_node.adapters.provider_http``), read as a run reads it."""

    def __init__(self, url: str) -> None:
        from iop_node.adapters.provider_http import ProviderHttp

        self._url = url + "/v1/chat/completions"
        self._http = ProviderHttp()
        self._headers = {"Content-Type": "application/json"}

    async def post(self) -> bytes:
        from iop_node.adapters.answer_read import read_answer

        response = await self._http.request(
            "POST", self._url, headers=self._headers, body=BODY, connect_timeout_s=10
        )
        async with response:
            return await read_answer(response, LIMIT)

    async def aclose(self) -> None:
        await self._http.aclose()


class TunedAiohttpClient(AiohttpClient):
    """aiohttp with per-request work the node has no use for turned off: no cookie
    jar (providers' cookies are not the node's to keep), the URL parsed once."""

    def __init__(self, url: str) -> None:
        import yarl

        self._url = yarl.URL(url + "/v1/chat/completions")  # type: ignore[assignment]
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._headers = {"Content-Type": "application/json"}


class _Exchange(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        import httptools  # optional: only this variant needs it

        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._chunks: list[bytes] = []
        self._done: asyncio.Future[bytes] | None = None
        self.reusable = True
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError("closed"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self.reusable = self._parser.should_keep_alive()
        body = b"".join(self._chunks)
        self._chunks = []
        if self._done is not None:
            self._done.set_result(body)

    async def exchange(self, request: bytes) -> bytes:
        assert self.transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self._done
        finally:
            self._done = None


class HttptoolsClient:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._idle: list[_Exchange] = []
        self._request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self._host}:{self._port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY

    async def post(self) -> bytes:
        if self._idle:
            exchange = self._idle.pop()
        else:
            _, exchange = await asyncio.get_running_loop().create_connection(
                _Exchange, self._host, self._port
            )
            await exchange.ready  # uvloop may return before connection_made ran
        body = await exchange.exchange(self._request)
        if exchange.reusable:
            self._idle.append(exchange)
        elif exchange.transport is not None:
            exchange.transport.close()
        return body

    async def aclose(self) -> None:
        for exchange in self._idle:
            if exchange.transport is not None:
                exchange.transport.close()


Client = AiohttpClient | HttptoolsClient | NodeClient


async def _drive(client: Client, requests: int, concurrency: int) -> None:
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            body = await client.post()
            assert body.startswith(b"{"), body[:100]

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())


async def main(requests: int, concurrencies: list[int], rounds: int) -> None:
    variants: dict[str, type[Client]] = {
        "aiohttp": AiohttpClient,
        "aiohttp-tuned": TunedAiohttpClient,
    }
    try:
        import httptools  # noqa: F401

        variants["httptools"] = HttptoolsClient
        variants["provider_http"] = NodeClient
    except ImportError:
        print("httptools is not importable: aiohttp alone", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="iop-client-") as scratch:
        async with fake_backend(Path(scratch) / "fake.log", "fake") as (url, _):
            for concurrency in concurrencies:
                cpu = dict.fromkeys(variants, 0.0)
                wall = dict.fromkeys(variants, 0.0)
                clients = {name: make(url) for name, make in variants.items()}
                for client in clients.values():  # connections made, code paths warm
                    await _drive(client, 200, concurrency)
                for i in range(rounds):
                    order = list(variants) if i % 2 == 0 else list(reversed(variants))
                    for name in order:
                        cpu0, wall0 = time.process_time(), time.perf_counter()
                        await _drive(clients[name], requests // rounds, concurrency)
                        cpu[name] += time.process_time() - cpu0
                        wall[name] += time.perf_counter() - wall0
                for client in clients.values():
                    await client.aclose()
                done = requests // rounds * rounds
                for name in variants:
                    print(
                        f"c={concurrency} {name}: {cpu[name] / done * 1e6:.0f} us CPU per request"
                        f" (client process), {done / wall[name]:.0f} req/s"
                    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main(args.requests, args.concurrency, args.rounds))


if __name__ == "__main__":
    cli()
