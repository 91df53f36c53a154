"""OpenAI's chat completions, completions and embeddings as a ``Dialect``.

The request body travels to the provider as the client sent it (only ``model``
is rewritten, by the dispatcher); the stream is ``formats.openai.ChunkStream``'s
chunks ending with ``data: [DONE]``; errors are OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_edge.entrypoints.api_dialect import DialectRequest
from iop_edge.entrypoints.inference_request import run_spec
from iop_edge.entrypoints.openai_errors import error_response
from iop_edge.errors import EdgeError
from iop_edge.formats.openai import (
    RENDER_OFFLOAD_BYTES,
    ChunkStream,
    render_result,
)


class OpenAIDialect:
    """Implements ``Dialect`` for one of OpenAI's three inference operations."""

    __slots__ = ("operation",)

    def __init__(self, operation: Operation) -> None:
        self.operation = operation

    def read(self, body: dict[str, Any]) -> DialectRequest:
        return DialectRequest(run_spec(self.operation, body))

    async def resolve(self, asked: DialectRequest, key: ApiKeyEntry | None) -> DialectRequest:
        return asked

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
