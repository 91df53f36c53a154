"""``POST /v1/responses/compact`` as a ``Dialect`` of the run pipeline.

The request is a response's input (``model``, ``input``, ``instructions``,
``previous_response_id``; the rest, tools included, is accepted and not used). The
pool's own model (the request's ``model``) summarises the conversation in one ordinary
chat run (``formats.responses_compaction.summary_body``), and the answer is the
specification's compaction response: ``object: "response.compaction"``, an ``output``
with the conversation's user messages as they were and then one ``compaction`` item
carrying the summary, and the run's ``usage``. A later request sends that output as its
input (Codex replaces its history with it); the compaction item becomes context there.

``instructions`` are not summarised: a client sends them again with every request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

from aiohttp import web

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_edge.entrypoints.api_dialect import DialectRequest, StreamWriter
from iop_edge.entrypoints.responses_dialect import ResponseDraft, ResponsesDialect, with_ids
from iop_edge.errors import EdgeError, InvalidRequest
from iop_edge.formats.responses_compaction import compaction_item, summary_body
from iop_edge.formats.responses_output import Turn, response_id
from iop_edge.formats.responses_request import chat_body
from iop_edge.ports import ResponseStore
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


class CompactDialect:
    """Implements ``Dialect`` for ``POST /v1/responses/compact``."""

    operation = Operation.CHAT_COMPLETIONS

    def __init__(self, store: ResponseStore) -> None:
        self._responses = ResponsesDialect(store)  # its reading, and previous_response_id

    def read(self, body: dict[str, Any]) -> DialectRequest:
        if body.get("stream") not in (None, False):
            raise InvalidRequest("A compaction is not streamed.", param="stream")
        asked: dict[str, Any] = {name: body[name] for name in READ_FIELDS if name in body}
        return self._responses.read({**asked, "store": False})

    async def resolve(self, asked: DialectRequest, key: ApiKeyEntry | None) -> DialectRequest:
        resolved = await self._responses.resolve(asked, key)
        draft: ResponseDraft = resolved.context
        conversation = dataclasses.replace(draft.request, instructions=None, tools=[])
        messages = chat_body(conversation, draft.history)["messages"]
        body = summary_body(draft.request.model, messages, draft.request.max_output_tokens)
        return DialectRequest(dataclasses.replace(resolved.spec, body=body), draft)

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> StreamWriter:
        raise InvalidRequest("A compaction is not streamed.", param="stream")  # read refuses it

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        draft: ResponseDraft = request.context
        turn = Turn.of_run(end, tuple(deltas))
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
                "output": [*kept, compaction_item(f"cmp_{run_id}", "".join(turn.text))],
                "usage": turn.usage_object(),
            }
        )

    def error_response(self, exc: EdgeError) -> web.Response:
        return self._responses.error_response(exc)
