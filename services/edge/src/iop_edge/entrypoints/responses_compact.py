"""``POST /v1/responses/compact``, and compaction turns of ``/v1/responses``, as
``Dialect``s of the run pipeline.

The request is a response's input (``model``, ``input``, ``instructions``,
``previous_response_id``; the rest, tools included, is accepted and not used). The
pool's own model (the request's ``model``) summarises the conversation in one ordinary
chat run (``formats.responses_compaction.summary_body``), and the answer is the
specification's compaction response: ``object: "response.compaction"``, an ``output``
with the conversation's user messages as they were and then one ``compaction`` item
carrying the summary, and the run's ``usage``. A later request sends that output as its
input (Codex replaces its history with it); the compaction item becomes context there.

``instructions`` are not summarised: a client sends them again with every request.

A ``/v1/responses`` request (HTTP or WebSocket) whose input ends with Codex's
``compaction_trigger`` item (its remote compaction v2) is the same summary run, answered
as a response whose one output item is the ``compaction`` item (streamed as that item's
``added``/``done`` events, then ``response.completed``): ``ResponsesOrCompaction`` sends
such a request here and every other to ``ResponsesDialect``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_edge.domain.usage import Api
from iop_edge.entrypoints.api_dialect import DialectRequest, StreamWriter
from iop_edge.entrypoints.responses_dialect import ResponseDraft, ResponsesDialect, with_ids
from iop_edge.errors import EdgeError, InvalidRequest
from iop_edge.formats.responses_compaction import (
    TRIGGER,
    CompactionEvents,
    asks_compaction,
    compaction_id,
    compaction_item,
    summary_body,
)
from iop_edge.formats.responses_output import Turn, response_id, response_object
from iop_edge.formats.responses_request import chat_body
from iop_edge.formats.responses_tools import Tools
from iop_proto import json_codec

READ_FIELDS: Final = (
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "max_output_tokens",
)
"""What a compact request's body is read for; tools, reasoning, text, include... are
the conversation's settings, not the summary's (and need no checking here)."""


@dataclass(frozen=True, slots=True)
class CompactionDraft:
    """A compaction's request: the response it reads as (``draft``), and whether it is
    answered as a response (a ``compaction_trigger`` turn) or as ``/compact``'s object."""

    draft: ResponseDraft
    as_response: bool


class CompactDialect:
    """Implements ``Dialect`` for ``POST /v1/responses/compact`` (and, through
    ``ResponsesOrCompaction``, for compaction turns)."""

    operation = Operation.CHAT_COMPLETIONS
    api = Api.RESPONSES

    def __init__(self, responses: ResponsesDialect) -> None:
        self._responses = responses  # its reading, and previous_response_id

    def read(self, body: dict[str, Any]) -> DialectRequest:
        if body.get("stream") not in (None, False):
            raise InvalidRequest("A compaction is not streamed.", param="stream")
        return self._read(body, as_response=False)

    def read_turn(self, body: dict[str, Any]) -> DialectRequest:
        """A ``/v1/responses`` body whose input ends with ``compaction_trigger``."""
        items = [
            item
            for item in body["input"]
            if not (isinstance(item, dict) and item.get("type") == TRIGGER)
        ]
        return self._read({**body, "input": items}, as_response=True)

    def _read(self, body: dict[str, Any], *, as_response: bool) -> DialectRequest:
        asked: dict[str, Any] = {name: body[name] for name in READ_FIELDS if name in body}
        asked["stream"] = body.get("stream", False) if as_response else False
        read = self._responses.read({**asked, "store": False})
        return DialectRequest(read.spec, CompactionDraft(read.context, as_response))

    async def resolve(self, asked: DialectRequest, key: ApiKeyEntry | None) -> DialectRequest:
        compaction: CompactionDraft = asked.context
        resolved = await self._responses.resolve(DialectRequest(asked.spec, compaction.draft), key)
        draft: ResponseDraft = resolved.context
        conversation = dataclasses.replace(draft.request, instructions=None, tools=Tools())
        messages = chat_body(conversation, draft.history)["messages"]
        request = draft.request
        body = summary_body(request.model, messages, request.max_output_tokens, request.stream)
        spec = dataclasses.replace(resolved.spec, body=body)
        return DialectRequest(spec, dataclasses.replace(compaction, draft=draft))

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> StreamWriter:
        compaction: CompactionDraft = request.context  # read refuses a streamed /compact
        return CompactionEvents(compaction.draft.request.echo, run_id, created)

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        compaction: CompactionDraft = request.context
        draft = compaction.draft
        turn = Turn.of_run(end, tuple(deltas))
        item = compaction_item(compaction_id(run_id), "".join(turn.text))
        if compaction.as_response:
            response = response_object(
                draft.request.echo,
                run_id,
                created,
                status="completed",
                output=[item],
                usage=turn.usage_object(),
                completed_at=int(time.time()),
            )
            return json_codec.dumps(response)
        conversation = [*draft.history, *with_ids(draft.request.items, run_id)]
        kept = [
            item
            for item in conversation
            if item.get("type", "message") == "message" and item.get("role") == "user"
        ]
        return json_codec.dumps(
            {
                "id": response_id(run_id),
                "object": "response.compaction",
                "created_at": created,
                "output": [*kept, item],
                "usage": turn.usage_object(),
            }
        )

    def error_response(self, exc: EdgeError) -> web.Response:
        return self._responses.error_response(exc)


class ResponsesOrCompaction:
    """Implements ``Dialect`` for ``/v1/responses``: a request that ends with
    ``compaction_trigger`` is a compaction turn (``CompactDialect``), any other a
    response (``ResponsesDialect``)."""

    operation = Operation.CHAT_COMPLETIONS
    api = Api.RESPONSES

    def __init__(self, responses: ResponsesDialect) -> None:
        self._responses = responses
        self._compact = CompactDialect(responses)

    def read(self, body: dict[str, Any]) -> DialectRequest:
        if asks_compaction(body):
            return self._compact.read_turn(body)
        return self._responses.read(body)

    async def resolve(self, asked: DialectRequest, key: ApiKeyEntry | None) -> DialectRequest:
        if isinstance(asked.context, CompactionDraft):
            return await self._compact.resolve(asked, key)
        return await self._responses.resolve(asked, key)

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> StreamWriter:
        if isinstance(request.context, CompactionDraft):
            return self._compact.stream_writer(request, run_id, created)
        return self._responses.stream_writer(request, run_id, created)

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        if isinstance(request.context, CompactionDraft):
            return await self._compact.answer(request, end, deltas, run_id, created)
        return await self._responses.answer(request, end, deltas, run_id, created)

    def error_response(self, exc: EdgeError) -> web.Response:
        return self._responses.error_response(exc)
