"""WebSocket mode of the Responses API: ``GET /v1/responses`` upgraded to a WebSocket.

A client (Codex CLI with ``supports_websockets``, OpenAI's SDKs' ``responses.connect``)
keeps one socket open and sends ``{"type": "response.create", ...}`` messages, each the
body of a ``POST /v1/responses`` (``stream`` is implied). Each response streams back as
the same events the SSE stream carries, one JSON text frame per event, written by the
same code: the run pipeline (``InferenceRoutes.serve_stream``) and the dialect's stream
writer, with ``SocketOut`` taking each SSE event's ``data`` as a frame. Responses run one
after the other on a socket; a ``response.create`` while one is in flight is refused.

The connection keeps its own last responses (``RecentResponses``), so a
``previous_response_id`` of this connection continues even with ``store: false``; other
ids are looked up in the store as over HTTP. ``generate: false`` (a warm-up) answers a
completed response with no output without running the model: its input becomes the
state the next response continues. Errors before a response's first event are ``error``
events carrying the HTTP status and OpenAI's error object (what Codex reads); the
socket stays open. The key is checked at the upgrade (a 401 there) and again for each
``response.create`` (a revoked key's socket is closed after its error event).
A socket closed by the client cancels the response in flight (its slot is released);
a socket idle for ``idle_timeout_s`` (no message, nothing running) is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, MutableMapping
from typing import Any, Final

from aiohttp import WSCloseCode, WSMsgType, web
from loguru import logger

from iop_edge.domain.events import Usage
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.entrypoints.inference_request import parse_json_object
from iop_edge.entrypoints.inference_routes import InferenceRoutes
from iop_edge.entrypoints.responses_compact import ResponsesOrCompaction
from iop_edge.entrypoints.responses_dialect import ResponseDraft, ResponsesDialect, with_ids
from iop_edge.errors import AuthenticationFailed, EdgeError, InvalidRequest, StorageUnavailable
from iop_edge.formats.errors import internal_error
from iop_edge.formats.reasoning_seal import ReasoningSeal
from iop_edge.formats.responses_output import response_object, usage_object
from iop_edge.formats.responses_stream import ResponseEventStream
from iop_edge.ports import KeyRing, ResponseStore
from iop_proto import json_codec
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.service.logging import log_unexpected

IDLE_TIMEOUT_S: Final = 600.0
"""A socket with no message and no response running this long is closed (1000)."""
HEARTBEAT_S: Final = 30.0
"""aiohttp pings this often and closes a socket whose peer does not answer."""
RECENT_RESPONSES: Final = 8
"""Responses a connection keeps for ``previous_response_id`` (OpenAI keeps the last one)."""
ACTIVE_RESPONSE: Final = "conversation_already_has_active_response"
"""The code of the error a second ``response.create`` gets while one runs (as OpenAI's
Realtime API names it)."""
IGNORED_EVENTS: Final = frozenset({"response.processed"})
"""Client events acknowledged by doing nothing (Codex tells it has read a response)."""


class UpgradeRequired(EdgeError):
    """``GET /v1/responses`` without a WebSocket upgrade."""

    status, type, code = 426, "invalid_request_error", "upgrade_required"


class RecentResponses:
    """Implements ``Recall``: the connection's last responses, each with the conversation
    a follow-up continues (its input, then its output), newest kept."""

    __slots__ = ("_kept", "_limit")

    def __init__(self, limit: int = RECENT_RESPONSES) -> None:
        self._limit = limit
        self._kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        items = self._kept.get(response_id)
        if items is None:
            return None
        self._kept.move_to_end(response_id)
        return list(items)  # the caller's to extend

    def remember(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if response.get("status") == "failed":
            self._kept.pop(response["id"], None)  # nothing to continue from
            return
        self._kept[response["id"]] = [*conversation, *(response.get("output") or ())]
        self._kept.move_to_end(response["id"])
        while len(self._kept) > self._limit:
            self._kept.popitem(last=False)


class SocketOut:
    """Implements ``StreamOut``: a run's SSE events sent as WebSocket text frames (each
    event's ``data``), the socket left open when the stream ends."""

    __slots__ = ("_ws", "headers", "prepared")

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self._ws = ws
        self.prepared = False
        self.headers: MutableMapping[str, str] = {}  # an HTTP answer's; not sent here

    async def prepare(self, request: web.BaseRequest) -> None:
        self.prepared = True

    async def write(self, data: bytes) -> None:
        for event in data.split(b"\n\n"):
            start = event.find(b"data: ")
            if start >= 0:
                await self._ws.send_frame(event[start + 6 :], WSMsgType.TEXT)

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)


class ResponsesWebSocket:
    """The ``GET /v1/responses`` handler; owns the open sockets (closed at shutdown)."""

    def __init__(
        self,
        inference: InferenceRoutes,
        store: ResponseStore,
        seal: ReasoningSeal,
        keys: KeyRing,
        max_message_bytes: int,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self._inference = inference
        self._store = store
        self._seal = seal
        self._keys = keys
        self._max_message_bytes = max_message_bytes
        self._idle_timeout_s = idle_timeout_s
        self._sockets: set[web.WebSocketResponse] = set()

    async def serve(self, request: web.Request) -> web.StreamResponse:
        key = authenticate(request, self._keys)  # before the upgrade: a plain 401
        ws = web.WebSocketResponse(max_msg_size=self._max_message_bytes, heartbeat=HEARTBEAT_S)
        if not ws.can_prepare(request).ok:
            raise UpgradeRequired(
                "GET /v1/responses is the Responses API's WebSocket mode: upgrade the "
                "connection to a WebSocket, or POST /v1/responses."
            )
        await ws.prepare(request)
        self._sockets.add(ws)
        try:
            recent = RecentResponses()
            responses = ResponsesDialect(self._store, self._seal, recent)
            connection = _Connection(
                self._inference, responses, recent, self._keys, request, ws, key
            )
            await connection.serve(self._idle_timeout_s)
        finally:
            self._sockets.discard(ws)
        return ws

    async def close_all(self, app: web.Application) -> None:
        """``on_shutdown``: after the drain, every socket left is told the server goes away."""
        for ws in list(self._sockets):
            with contextlib.suppress(ConnectionResetError):
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


class _Connection:
    """One socket: reads client events, runs their responses one at a time."""

    def __init__(
        self,
        inference: InferenceRoutes,
        responses: ResponsesDialect,
        recent: RecentResponses,
        keys: KeyRing,
        request: web.Request,
        ws: web.WebSocketResponse,
        key: ApiKeyEntry | None,
    ) -> None:
        self._inference = inference
        self._keys = keys
        self._request = request
        self._ws = ws
        self._key = key
        self._responses = responses  # recalls from ``recent``: this connection's own
        self._recent = recent
        self._dialect = ResponsesOrCompaction(self._responses)
        self._running: asyncio.Task[None] | None = None

    async def serve(self, idle_timeout_s: float) -> None:
        ws = self._ws
        try:
            while not ws.closed:
                try:
                    message = await ws.receive(timeout=idle_timeout_s)
                except TimeoutError:
                    if self._busy():
                        continue
                    await ws.close(code=WSCloseCode.OK, message=b"idle timeout")
                    break
                if message.type is WSMsgType.TEXT:
                    await self._event(message.data)
                elif message.type is WSMsgType.BINARY:
                    await self._error(InvalidRequest("Client events are JSON text frames."))
                else:  # CLOSE, CLOSING, CLOSED, ERROR (too large: aiohttp closed it, 1009)
                    break
        finally:
            running = self._running
            if running is not None:
                running.cancel()  # the client left: the pipeline cancels the run
                await asyncio.gather(running, return_exceptions=True)

    def _busy(self) -> bool:
        return self._running is not None and not self._running.done()

    async def _event(self, text: str) -> None:
        try:
            event = await parse_json_object(text)  # a body's limits: depth, NaN, off the loop
        except InvalidRequest as exc:
            await self._error(exc)
            return
        kind = event.get("type")
        if kind in IGNORED_EVENTS:
            return
        if kind != "response.create":
            await self._error(
                InvalidRequest(
                    f"Unsupported client event type {kind!r}; expected 'response.create'.",
                    param="type",
                )
            )
            return
        try:
            self._key = authenticate(self._request, self._keys)
        except AuthenticationFailed as exc:  # revoked since the upgrade
            await self._error(exc)
            await self._ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"key revoked")
            return
        if self._busy():
            refusal = InvalidRequest(
                "A response is already in progress on this connection; send the next "
                "response.create after its response.completed.",
            )
            refusal.code = ACTIVE_RESPONSE
            await self._error(refusal)
            return
        body = {name: value for name, value in event.items() if name != "type"}
        body["stream"] = True  # implied over a socket
        if body.pop("generate", True) is False:
            await self._guarded(self._warm_up(body))
        else:
            self._running = asyncio.create_task(self._guarded(self._respond(body)))

    async def _respond(self, body: dict[str, Any]) -> None:
        await self._inference.serve_stream(
            self._request, self._dialect, body, self._key, SocketOut(self._ws)
        )

    async def _warm_up(self, body: dict[str, Any]) -> None:
        """``generate: false``: a completed response without output; its input is what
        a follow-up of it continues."""
        asked = await self._responses.resolve(self._responses.read(body), self._key)
        draft: ResponseDraft = asked.context
        run_id = secrets.token_hex(16)
        created = int(time.time())
        echo = draft.request.echo
        events = ResponseEventStream(
            echo, run_id, created, self._responses.shape(draft.request), time.time
        )
        final = response_object(
            echo,
            run_id,
            created,
            status="completed",
            output=[],
            usage=usage_object(Usage()),
            completed_at=created,
        )
        completed = {"type": "response.completed", "sequence_number": 2, "response": final}
        await SocketOut(self._ws).write(events.opening())
        await self._ws.send_frame(json_codec.dumps(completed), WSMsgType.TEXT)
        self._recent.remember(final, [*draft.history, *with_ids(draft.request.items, run_id)])

    async def _guarded(self, work: Awaitable[None]) -> None:
        """The per-response boundary: an error before the first event becomes an
        ``error`` event; the socket goes on."""
        try:
            await work
        except EdgeError as exc:
            await self._error(exc)
        except StoreDown as exc:  # the shared store down: retryable, as api_gate answers it
            logger.warning("a WebSocket response: {}", exc)
            await self._error(StorageUnavailable("The store is unavailable now; retry shortly."))
        except ConnectionResetError:
            pass  # the client left while its error was written
        except Exception as exc:
            log_unexpected(exc, "a WebSocket response failed in the edge")
            await self._error(internal_error())

    async def _error(self, exc: EdgeError) -> None:
        answer = self._dialect.error_response(exc)
        payload = json_codec.loads(answer.text or "{}")
        error = payload.get("error") or {}
        event = {
            "type": "error",
            "status": answer.status,
            "code": error.get("code"),
            "message": error.get("message"),
            "param": error.get("param"),
            "error": error,
        }
        with contextlib.suppress(ConnectionResetError):
            await self._ws.send_frame(json_codec.dumps(event), WSMsgType.TEXT)
