"""``/v1/responses``: creating a response (the run pipeline, ``ResponsesDialect``), over
HTTP or a WebSocket (``responses_websocket``), compacting a conversation
(``responses_compact``), and reading, listing the input of, and deleting a stored one.

Every stored response belongs to the API key that made it: another key's id is
answered as not found, like files and batches. Errors leave through the app's
error boundary as OpenAI error objects.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiohttp import web

from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.entrypoints.inference_request import OFFLOAD_BYTES
from iop_edge.entrypoints.inference_routes import InferenceRoutes
from iop_edge.entrypoints.responses_compact import CompactDialect, ResponsesOrCompaction
from iop_edge.entrypoints.responses_dialect import ResponsesDialect, conversation
from iop_edge.entrypoints.responses_websocket import ResponsesWebSocket
from iop_edge.errors import InvalidRequest, NotFound
from iop_edge.formats.reasoning_seal import ReasoningSeal
from iop_edge.ports import KeyRing, ResponseStore, StoredResponse
from iop_proto import json_codec

ITEMS_DEFAULT_LIMIT: Final = 20
ITEMS_MAX_LIMIT: Final = 100
_ORDERS: Final = ("asc", "desc")


class ResponsesRoutes:
    """``POST /v1/responses`` (and ``GET``, its WebSocket mode), ``POST /v1/responses/compact``,
    and ``GET``/``DELETE /v1/responses/{id}``, ``.../input_items``."""

    def __init__(
        self, store: ResponseStore, keys: KeyRing, seal: ReasoningSeal, max_body_bytes: int
    ) -> None:
        self._store = store
        self._keys = keys
        self._seal = seal
        self._max_body_bytes = max_body_bytes  # a WebSocket message's limit too

    def register(self, app: web.Application, inference: InferenceRoutes) -> None:
        """``inference``: the run pipeline every response runs through."""
        router = app.router
        responses = ResponsesDialect(self._store, self._seal)
        router.add_post("/v1/responses", inference.route(ResponsesOrCompaction(responses)))
        socket = ResponsesWebSocket(
            inference, self._store, self._seal, self._keys, self._max_body_bytes
        )
        router.add_get("/v1/responses", socket.serve)
        app.on_shutdown.append(socket.close_all)
        router.add_post("/v1/responses/compact", inference.route(CompactDialect(responses)))
        router.add_get("/v1/responses/{response_id}", self.retrieve)
        router.add_delete("/v1/responses/{response_id}", self.delete)
        router.add_get("/v1/responses/{response_id}/input_items", self.input_items)

    async def retrieve(self, request: web.Request) -> web.Response:
        if request.query.get("stream") in ("true", "1"):
            raise InvalidRequest(
                "Streaming a stored response again is not supported by this server.",
                param="stream",
            )
        stored = await self._stored(request)
        return web.Response(body=stored.response_json, content_type="application/json")

    async def delete(self, request: web.Request) -> web.Response:
        """Committed before the answer; a later turn that continues it keeps working."""
        key_id, response_id = self._asked(request)
        if not await self._store.delete(response_id, key_id):
            raise _not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        """The conversation the response answered, OpenAI's list page (newest first by
        default; ``after`` an item id; ``limit`` 1 to 100)."""
        limit = _limit(request.query.get("limit"))
        order = request.query.get("order", "desc")
        if order not in _ORDERS:
            raise InvalidRequest("'order' must be asc or desc.", param="order")
        key_id, response_id = self._asked(request)
        chain = await self._store.chain(response_id, key_id)
        if chain is None:
            raise _not_found(response_id)
        if sum(link.size for link in chain) > OFFLOAD_BYTES:  # a long conversation: off the loop
            items = await asyncio.to_thread(_input_of, chain)
        else:
            items = _input_of(chain)
        if order == "desc":
            items.reverse()
        after = request.query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise NotFound(f"No input item with id '{after}' in this response.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return web.json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(items) > limit,
            }
        )

    async def _stored(self, request: web.Request) -> StoredResponse:
        key_id, response_id = self._asked(request)
        stored = await self._store.get(response_id, key_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    def _asked(self, request: web.Request) -> tuple[str, str]:
        """The caller's key id ("" for the open API) and the response id it names."""
        key = authenticate(request, self._keys)
        return key.key_id if key is not None else "", request.match_info["response_id"]


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id")


def _input_of(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    """The items the last turn answered: the turns before it (input, output), its input."""
    items = conversation(chain[:-1])
    items.extend(json_codec.loads(chain[-1].input_json))
    return items


def _limit(raw: str | None) -> int:
    if raw is None:
        return ITEMS_DEFAULT_LIMIT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= ITEMS_MAX_LIMIT:
        raise InvalidRequest(
            f"'limit' must be an integer from 1 to {ITEMS_MAX_LIMIT}.", param="limit"
        )
    return value
