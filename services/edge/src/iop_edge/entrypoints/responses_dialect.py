"""OpenAI's Responses API (``POST /v1/responses``) as a ``Dialect`` of the run pipeline.

The request runs as a chat completion on any provider (``formats.responses_request``);
the answer is a Response object (``formats.responses_output``) or its stream of
events (``formats.responses_stream``). With ``store`` (the default, as at OpenAI)
the turn is kept per API key (``ResponseStore``) when the run ends: its own input
and its answer, linked to the turn it continued, so ``previous_response_id``
continues it (the store walks the links back) and ``GET /v1/responses/{id}`` reads
it back. The answer (its JSON body, or the stream's last events) leaves only once
the turn is committed: a stored answer is never lost after the client saw it.

Hosted tools the request names are dropped (``responses_tools``): the answer says which
in its ``x-iop-dropped-tools`` header, and the edge logs it. Reasoning is sealed into
``encrypted_content`` with the edges' ``ReasoningSeal`` when the client asks, and opened
again when such an item comes back.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from aiohttp import web
from loguru import logger

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_edge.domain.usage import Api
from iop_edge.entrypoints.api_dialect import DialectRequest, dropped_tools_headers
from iop_edge.entrypoints.inference_request import OFFLOAD_BYTES
from iop_edge.entrypoints.openai_errors import error_response
from iop_edge.errors import EdgeError, InvalidRequest, NotFound, StorageUnavailable
from iop_edge.formats.reasoning_seal import ReasoningSeal
from iop_edge.formats.responses_output import OutputShape, Turn, response_id, response_object
from iop_edge.formats.responses_request import ResponsesRequest, chat_body, read_request
from iop_edge.formats.responses_stream import ResponseEventStream
from iop_edge.ports import ResponseStore, RunSpec, StoredResponse
from iop_proto import json_codec
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.service.logging import log_unexpected

CHAT_PARAMS: Final = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}
"""A chat body's fields, named in errors the dispatcher or a provider raise about them,
as the Responses request called them."""
_ID_PREFIXES: Final = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}


class Recall(Protocol):
    """A WebSocket connection's own recent responses (``responses_websocket``): what
    ``previous_response_id`` continues first, kept even with ``store: false``."""

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items a follow-up of ``response_id`` continues (input, then output)."""
        ...

    def remember(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` (a Response object) with the ``conversation`` it answered."""
        ...


@dataclass(slots=True)
class ResponseDraft:
    """What the dialect keeps of one request until its answer is written."""

    request: ResponsesRequest
    key_id: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    previous: StoredResponse | None = None  # the stored turn it continues


class ResponsesDialect:
    """Implements ``Dialect`` for ``POST /v1/responses``."""

    operation = Operation.CHAT_COMPLETIONS  # what every provider runs, and the run log says
    api = Api.RESPONSES

    def __init__(
        self, store: ResponseStore, seal: ReasoningSeal, recall: Recall | None = None
    ) -> None:
        self._store = store
        self._seal = seal
        self._recall = recall

    def read(self, body: dict[str, Any]) -> DialectRequest:
        request = read_request(body)
        # With a previous response the body is made once its conversation is read (resolve).
        chat = (
            chat_body(request, (), self._seal.open) if request.previous_response_id is None else {}
        )
        spec = RunSpec(
            model=request.model,
            operation=self.operation,
            body=chat,
            stream=request.stream,
            include_usage=request.stream,
            chained=True,  # its response id may name the next turn's previous response
        )
        headers = dropped_tools_headers("responses", request.model, request.tools.dropped)
        return DialectRequest(spec, ResponseDraft(request), headers)

    async def resolve(self, asked: DialectRequest, key: ApiKeyEntry | None) -> DialectRequest:
        draft: ResponseDraft = asked.context
        draft.key_id = key.key_id if key is not None else ""
        if draft.request.store:  # refused before it runs, not after
            self._store.admit(draft.key_id, len(json_codec.dumps(draft.request.items)))
        previous_id = draft.request.previous_response_id
        if previous_id is None:
            return asked
        recalled = self._recall.conversation(previous_id) if self._recall is not None else None
        if recalled is not None:
            draft.history = recalled
            if draft.request.store:  # linked to it if it was stored, else a first turn
                previous = await self._store.get(previous_id, draft.key_id)
                if previous is not None and previous.depth < self._store.max_depth:
                    draft.previous = previous
            body = chat_body(draft.request, recalled)
            return DialectRequest(dataclasses.replace(asked.spec, body=body), draft)
        chain = await self._store.chain(previous_id, draft.key_id)
        tip = chain[-1] if chain else await self._store.get(previous_id, draft.key_id)
        if tip is not None and tip.depth + 1 > self._store.max_depth:
            raise InvalidRequest(
                f"The conversation of '{previous_id}' has {tip.depth + 1} turns, the"
                f" most this server continues ({self._store.max_depth}); compact it"
                " (/v1/responses/compact) or start a new one.",
                param="previous_response_id",
                code="conversation_too_long",
            )
        if chain is None:
            raise NotFound(
                f"Previous response with id '{previous_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",  # OpenAI's, which clients key on
            )
        draft.previous = chain[-1]
        if sum(link.size for link in chain) > OFFLOAD_BYTES:  # a long conversation: off the loop
            history = await asyncio.to_thread(conversation, chain)
        else:
            history = conversation(chain)
        draft.history = history
        body = chat_body(draft.request, history, self._seal.open)
        return DialectRequest(dataclasses.replace(asked.spec, body=body), draft)

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> ResponsesStream:
        draft: ResponseDraft = request.context
        shape = self.shape(draft.request)
        events = ResponseEventStream(draft.request.echo, run_id, created, shape, time.time)
        return ResponsesStream(events, self._keeper(draft, run_id, created))

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
        reason = turn.incomplete_reason
        response = response_object(
            draft.request.echo,
            run_id,
            created,
            status="incomplete" if reason else "completed",
            output=turn.output(run_id, self.shape(draft.request)),
            usage=turn.usage_object(),
            incomplete_reason=reason,
            completed_at=None if reason else int(time.time()),
        )
        keep = self._keeper(draft, run_id, created)
        if keep is not None:
            await keep(response)
        return json_codec.dumps(response)

    def error_response(self, exc: EdgeError) -> web.Response:
        name = CHAT_PARAMS.get(exc.param or "")
        if name is not None and exc.param is not None:
            renamed = copy.copy(exc)
            renamed.message = exc.message.replace(exc.param, name)
            renamed.param = name
            exc = renamed
        return error_response(exc)

    def shape(self, request: ResponsesRequest) -> OutputShape:
        """How this request's output items are made (its tools; sealed reasoning or not)."""
        return OutputShape(request.tools, self._seal.seal if request.sealed_reasoning else None)

    def _keeper(
        self, draft: ResponseDraft, run_id: str, created: int
    ) -> Callable[[dict[str, Any]], Awaitable[None]] | None:
        """What keeps the answer, or None with ``store: false`` (and no ``Recall``)."""
        recall = self._recall
        if not draft.request.store:
            if recall is None:
                return None

            async def remember(response: dict[str, Any]) -> None:
                recall.remember(response, [*draft.history, *with_ids(draft.request.items, run_id)])

            return remember
        store = self._store

        async def keep(response: dict[str, Any]) -> None:
            items = with_ids(draft.request.items, run_id)
            if recall is not None:
                recall.remember(response, [*draft.history, *items])
            previous = draft.previous
            if previous is None:  # a first turn, or one continuing what was not stored
                items = [*draft.history, *items]
            record = StoredResponse(
                response_id=response_id(run_id),
                key_id=draft.key_id,
                created_at=created,
                response_json=json_codec.dumps(response),
                input_json=json_codec.dumps(items),
                previous_id=None if previous is None else previous.response_id,
                depth=0 if previous is None else previous.depth + 1,
            )
            try:
                await store.keep(record)
            except Exception as exc:
                # Not acknowledged as stored: the client gets an error instead. The shared
                # store down is an outage, said in one line; anything else, a bug.
                if isinstance(exc, StoreDown):
                    logger.warning("could not store response {}: {}", record.response_id, exc)
                else:
                    log_unexpected(exc, "could not store response {}", record.response_id)
                raise StorageUnavailable(
                    "The response could not be stored; try again, or send store: false."
                ) from None

        return keep


class ResponsesStream:
    """Implements ``StreamWriter``: the event stream, and the answer kept when it ends
    (``settle``, before the last events leave)."""

    __slots__ = ("_events", "_keep", "delta")

    def __init__(
        self,
        events: ResponseEventStream,
        keep: Callable[[dict[str, Any]], Awaitable[None]] | None,
    ) -> None:
        self._events = events
        self._keep = keep
        self.delta = events.delta  # bound once: the per-token call goes straight to it

    def opening(self) -> bytes:
        return self._events.opening()

    def closing(self, end: Completed) -> bytes:
        return self._events.closing(end)

    def failure(self, error: EdgeError) -> bytes:
        return self._events.failure(error)

    async def settle(self) -> None:
        keep, self._keep = self._keep, None  # once: a failure after a closing keeps nothing
        if keep is not None and self._events.final is not None:
            await keep(self._events.final)


def conversation(chain: Sequence[StoredResponse]) -> list[dict[str, Any]]:
    """What a follow-up of the chain's last turn continues: each turn's input, then its
    output, the first turn first."""
    history: list[dict[str, Any]] = []
    for turn in chain:
        history.extend(json_codec.loads(turn.input_json))
        history.extend(json_codec.loads(turn.response_json).get("output") or ())
    return history


def with_ids(items: Sequence[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """Input items as stored and listed: each with an id, a message's content as parts."""
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        stored = dict(item)
        stored.setdefault("id", f"{_ID_PREFIXES.get(kind, 'item')}_{run_id}_{index}")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            stored["content"] = [{"type": part, "text": item["content"]}]
        out.append(stored)
    return out
