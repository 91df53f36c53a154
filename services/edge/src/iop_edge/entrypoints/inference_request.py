"""Reading and checking an inference request body: parsed once, validated, passed on.

Only what the edge itself needs is checked (model, the operation's required
input, streaming switches, ``n``); every other field travels untouched in
``RunSpec.body`` to the provider, so vendor parameters keep working.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiohttp import web

from iop_edge.domain.fleet import Operation
from iop_edge.errors import InvalidRequest, RequestTooLarge
from iop_edge.ports import RunSpec
from iop_edge.service.limits import MAX_JSON_DEPTH
from iop_proto import json_codec

OFFLOAD_BYTES: Final = 256 * 1024
"""JSON larger than this is parsed in a worker thread: a multi-megabyte body (images,
long contexts, embeddings) would otherwise hold the event loop for milliseconds."""


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
    # NaN and Infinity are not JSON: refused here rather than by a provider later.
    try:
        if len(raw) > OFFLOAD_BYTES:
            body = await asyncio.to_thread(
                json_codec.loads, raw, allow_nan=False, max_depth=MAX_JSON_DEPTH
            )
        else:
            body = json_codec.loads(raw, allow_nan=False, max_depth=MAX_JSON_DEPTH)
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


def run_spec(operation: Operation, body: dict[str, Any]) -> RunSpec:
    """The run ``body`` asks for, after checking the fields the edge relies on;
    ``InvalidRequest`` naming the param otherwise."""
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
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    if stream and operation is Operation.EMBEDDINGS:
        raise InvalidRequest("Embeddings cannot be streamed.", param="stream")
    if operation is not Operation.EMBEDDINGS:
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise InvalidRequest(
                "Only n=1 is supported (not every provider can return several choices).",
                param="n",
            )
    include_usage: bool = False
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
        asked = options.get("include_usage")
        if isinstance(asked, bool):
            include_usage = asked
        elif asked is not None:
            param = "stream_options.include_usage"
            raise InvalidRequest(f"'{param}' must be a boolean.", param=param)
    return RunSpec(
        model=model,
        operation=operation,
        body=body,
        stream=stream,
        include_usage=include_usage,
    )
