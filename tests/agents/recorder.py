"""A recording relay between a coding agent and the edge: every request the agent sends is
kept (method, path, the headers that are not secrets, the body) and passed on unchanged.

The agents are the real programs at pinned versions, so what they send is the contract IOP
must meet; the relay is how the tests see it. It relays WebSocket upgrades too (Codex's
Responses WebSocket mode), keeping each message the agent sends on the socket.

Only loopback: it binds 127.0.0.1 on an ephemeral port and talks only to the edge's URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie"})
HOP_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
)


@dataclass
class Exchange:
    """One request as the agent sent it, and the status the edge answered."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    answer: bytes = b""
    socket_messages: list[str] = field(default_factory=list)  # WebSocket: what the agent sent
    socket_replies: list[str] = field(default_factory=list)  # WebSocket: what the edge sent

    @property
    def json(self) -> Any:
        """The body as JSON (``None`` when empty)."""
        return json.loads(self.body) if self.body else None

    def as_record(self) -> dict[str, Any]:
        """The exchange as a fixture: secrets are never in ``headers``."""
        record: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "headers": self.headers,
            "status": self.status,
        }
        if self.body:
            record["body"] = self.json
        if self.socket_messages:
            record["socket_messages"] = [json.loads(m) for m in self.socket_messages]
        return record


class Recorder:
    """The relay's state: the upstream and what passed through."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.url = ""

    def clear(self) -> None:
        self.exchanges.clear()

    def posts(self, path_prefix: str) -> list[Exchange]:
        """The POSTs (and WebSocket sessions) whose path starts with ``path_prefix``."""
        return [
            e
            for e in self.exchanges
            if e.path.startswith(path_prefix) and (e.method == "POST" or e.socket_messages)
        ]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SECRET_HEADERS}
        exchange = Exchange(request.method, request.path_qs, headers, await request.read())
        self.exchanges.append(exchange)
        forwarded = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._relay_socket(request, exchange, forwarded)
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with http.request(
                request.method,
                self.upstream + request.path_qs,
                data=exchange.body,
                headers=forwarded,
                allow_redirects=False,
            ) as upstream:
                exchange.status = upstream.status
                reply = web.StreamResponse(
                    status=upstream.status,
                    headers={
                        k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS
                    },
                )
                await reply.prepare(request)
                chunks: list[bytes] = []
                async for chunk in upstream.content.iter_any():
                    chunks.append(chunk)
                    await reply.write(chunk)
                exchange.answer = b"".join(chunks)
                await reply.write_eof()
                return reply

    async def _relay_socket(
        self, request: web.Request, exchange: Exchange, forwarded: dict[str, str]
    ) -> web.StreamResponse:
        for name in ("sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions"):
            forwarded = {k: v for k, v in forwarded.items() if k.lower() != name}
        async with aiohttp.ClientSession() as http:
            try:
                upstream = await http.ws_connect(
                    self.upstream.replace("http", "ws", 1) + request.path_qs,
                    headers=forwarded,
                    max_msg_size=0,
                )
            except aiohttp.WSServerHandshakeError as refused:
                exchange.status = refused.status
                return web.Response(status=refused.status, text=refused.message)
            exchange.status = 101
            client = web.WebSocketResponse(max_msg_size=0)
            await client.prepare(request)

            async def agent_to_edge() -> None:
                async for message in client:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        exchange.socket_messages.append(message.data)
                        await upstream.send_str(message.data)
                await upstream.close()

            async def edge_to_agent() -> None:
                async for message in upstream:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        exchange.socket_replies.append(message.data)
                        await client.send_str(message.data)
                await client.close()

            async with asyncio.TaskGroup() as group:
                group.create_task(agent_to_edge())
                group.create_task(edge_to_agent())
            return client


@contextlib.asynccontextmanager
async def recording(upstream: str) -> AsyncIterator[Recorder]:
    """A relay to ``upstream`` (the edge's origin, no ``/v1``) on 127.0.0.1; its ``url``
    is the origin agents are given."""
    recorder = Recorder(upstream)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    recorder.url = f"http://127.0.0.1:{port}"
    try:
        yield recorder
    finally:
        await runner.cleanup()
