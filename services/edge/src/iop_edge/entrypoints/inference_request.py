"""Reading and checking an inference request body: parsed once, validated, passed on.

Only what the edge itself needs is checked (model, the operation's required
input, streaming switches, ``n``); every other field travels untouched in
``RunSpec.body`` to the provider, so vendor parameters keep working.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from iop_edge.domain.fleet import Operation
from iop_edge.errors import InvalidRequest, RequestTooLarge
from iop_edge.service.limits import MAX_JSON_DEPTH
from iop_proto import json_codec

OFFLOAD_BYTES: Final = 256 * 1024
"""JSON larger than this is parsed in a worker thread: a multi-megabyte body (images,
long contexts, embeddings) would otherwise hold the event loop for milliseconds."""


@dataclass(frozen=True, slots=True)
class InferenceParams:
    """What the edge reads from a body; the rest is the provider's business."""

    model: str
    stream: bool
    include_usage: bool


async def read_json_body(request: web.BaseRequest) -> dict[str, Any]:
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
    return await parse_json_object(raw)


async def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    """``raw`` (a body, or a WebSocket message) as a JSON object, with a body's checks."""
    try:
        if len(raw) > OFFLOAD_BYTES:
            body = await asyncio.to_thread(_parse, raw)
        else:
            body = _parse(raw)
    except json_codec.JsonTooDeep as exc:
        raise InvalidRequest(
            f"The request body is nested deeper than {exc.max_depth} levels, "
            "this server's limit for JSON."
        ) from None
    except (ValueError, RecursionError):
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be valid JSON."
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def parse_params(operation: Operation, body: dict[str, Any]) -> InferenceParams:
    """Check the fields the edge relies on; raises ``InvalidRequest`` naming the param."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("You must provide a model parameter (a string).", param="model")
    if operation is Operation.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
    elif operation is Operation.COMPLETIONS:
        if not isinstance(body.get("prompt"), str | list):
            raise InvalidRequest(
                "'prompt' is required: a string or an array of strings or tokens.",
                param="prompt",
            )
    else:
        value = body.get("input")
        if not isinstance(value, str | list) or not value:
            raise InvalidRequest("'input' is required: a non-empty string or array.", param="input")
    stream = _optional_bool(body, "stream", "stream")
    if stream and operation is Operation.EMBEDDINGS:
        raise InvalidRequest("Embeddings cannot be streamed.", param="stream")
    if operation is not Operation.EMBEDDINGS:
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise InvalidRequest(
                "Only n=1 is supported (not every provider can return several choices).",
                param="n",
            )
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
        if not stream:
            # OpenAI refuses it too, and vLLM would reject the run after it queued.
            raise InvalidRequest(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        include_usage = _optional_bool(options, "include_usage", "stream_options.include_usage")
    return InferenceParams(model=model, stream=stream, include_usage=include_usage)


def _optional_bool(container: dict[str, Any], field: str, param: str) -> bool:
    value = container.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{param}' must be a boolean.", param=param)
    return value


def _parse(raw: bytes | str) -> Any:
    # NaN and Infinity are not JSON: refused here rather than by a provider later.
    return json_codec.loads(raw, allow_nan=False, max_depth=MAX_JSON_DEPTH)
