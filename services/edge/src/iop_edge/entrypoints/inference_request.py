"""Reading an inference request body: read once, parsed once, as a JSON object.

What its fields must be is each dialect's to check (``Dialect.read``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiohttp import web

from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.errors import InvalidRequest, RequestTooLarge
from iop_edge.service.limits import MAX_JSON_DEPTH
from iop_proto import json_codec

OFFLOAD_BYTES: Final = 256 * 1024
"""JSON larger than this is parsed in a worker thread: a multi-megabyte body (images,
long contexts, embeddings) would otherwise hold the event loop for milliseconds."""


async def read_json_body(request: ApiRequest) -> dict[str, Any]:
    """The body as a JSON object, parsed once; ``InvalidRequest`` (400/413) otherwise.

    Its size is bounded by the app's body limit and its nesting here, at parse time
    (``iop_edge.service.limits``): a body that reads can always be written again for its node.
    """
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise RequestTooLarge(f"The request body is too large ({exc.text}).") from None
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    if len(raw) > OFFLOAD_BYTES:
        return await parse_json_object(raw)
    return _json_object(raw)


async def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    """``raw`` (a body, or a WebSocket message) as a JSON object, with a body's checks;
    a large one parsed off the event loop."""
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.to_thread(_json_object, raw)
    return _json_object(raw)


def _json_object(raw: bytes | str) -> dict[str, Any]:
    """The one parse of a body: JSON, no NaN, nested at most ``MAX_JSON_DEPTH``, an object."""
    try:
        body = json_codec.loads(raw, allow_nan=False, max_depth=MAX_JSON_DEPTH)
    except (ValueError, RecursionError) as exc:
        raise _unreadable(exc) from None
    if not isinstance(body, dict):
        raise InvalidRequest(NOT_AN_OBJECT)
    return body


NOT_AN_OBJECT: Final = "The request body must be a JSON object."


def _unreadable(exc: ValueError | RecursionError) -> InvalidRequest:
    """Why JSON could not be read, for the client. NaN and Infinity are not JSON: they
    are refused here rather than by a provider later."""
    if isinstance(exc, json_codec.JsonTooDeep):
        return InvalidRequest(
            f"The request body is nested deeper than {exc.max_depth} levels, "
            "this server's limit for JSON."
        )
    return InvalidRequest(
        "We could not parse the JSON body of your request. The body must be valid JSON."
    )
