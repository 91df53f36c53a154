"""OpenAI's chat completions, completions and embeddings as a ``Dialect``.

The request body travels to the provider as the client sent it (only ``model``
is rewritten, by the dispatcher); the stream is ``formats.openai.ChunkStream``'s
chunks ending with ``data: [DONE]``; errors are OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any, Final

from aiohttp import web

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import Operation
from iop_edge.domain.usage import Api
from iop_edge.entrypoints.api_dialect import DialectRequest
from iop_edge.entrypoints.openai_errors import error_response
from iop_edge.errors import EdgeError, InvalidRequest
from iop_edge.formats.openai import (
    RENDER_OFFLOAD_BYTES,
    ChunkStream,
    render_result,
)
from iop_edge.ports import RunSpec


class OpenAIDialect:
    """Implements ``Dialect`` for one of OpenAI's three inference operations."""

    __slots__ = ("api", "operation")

    def __init__(self, operation: Operation) -> None:
        self.operation = operation
        self.api = Api(operation.value)  # each of OpenAI's three is an API of its own

    def read(self, body: dict[str, Any]) -> DialectRequest:
        """The run ``body`` asks for. Only what the edge itself needs is checked (model, the
        operation's required input, streaming switches, ``n``), each refusal naming its
        param; every other field travels untouched in ``RunSpec.body`` to the provider,
        so vendor parameters keep working."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("You must provide a model parameter (a string).", param="model")
        if self.operation is Operation.CHAT_COMPLETIONS:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
        elif self.operation is Operation.COMPLETIONS:
            if not isinstance(body.get("prompt"), str | list):
                raise InvalidRequest(
                    "'prompt' is required: a string or an array of strings or tokens.",
                    param="prompt",
                )
        else:
            value = body.get("input")
            if not isinstance(value, str | list) or not value:
                raise InvalidRequest(
                    "'input' is required: a non-empty string or array.", param="input"
                )
        stream = body.get("stream")
        if stream is None:
            stream = False
        elif not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean.", param="stream")
        if stream and self.operation is Operation.EMBEDDINGS:
            raise InvalidRequest("Embeddings cannot be streamed.", param="stream")
        if self.operation is not Operation.EMBEDDINGS:
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
        spec = RunSpec(
            model=model,
            operation=self.operation,
            body=body,
            stream=stream,
            include_usage=include_usage,
        )
        return DialectRequest(spec)

    resolve: Final = None  # the body is the whole request: nothing stored to read

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> ChunkStream:
        spec = request.spec
        return ChunkStream(
            spec.operation,
            run_id=run_id,
            model=spec.model,
            created=created,
            include_usage=spec.include_usage,
        )

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        spec = request.spec
        render = functools.partial(
            render_result,
            spec.operation,
            end,
            deltas,
            run_id=run_id,
            model=spec.model,
            created=created,
        )
        if len(end.result_json) > RENDER_OFFLOAD_BYTES:
            return await asyncio.to_thread(render)
        return render()

    def error_response(self, exc: EdgeError) -> web.Response:
        return error_response(exc)
