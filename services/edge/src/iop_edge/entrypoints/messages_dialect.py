"""Anthropic's Messages API as a ``Dialect``: ``POST /v1/messages`` and its ``count_tokens``.

A request is translated into a chat-completions body (``formats.anthropic_request``)
and runs through the shared pipeline like any chat completion: the same keys and
allow-lists, queue, selection, failover, cancellation and run log, on every
provider. Its answer and stream are written back as Anthropic's
(``formats.anthropic``), and so are its errors: here for the handler's, and through
``is_messages_path`` for those the middlewares raise before it (authentication,
the loopback rule, unknown routes, the stop gate).

Every answer on these paths (and ``/v1/models`` asked with ``anthropic-version``)
carries ``request-id``, as Anthropic's do: ``req_`` and the run's id, or a fresh id
for an answer no run was opened for (``mark_request_id``). A request whose server
tools were left out (``dropped_tools``) is answered with ``x-iop-dropped-tools``
naming their types, and logged.

``count_tokens`` asks the model's own tokenizer and chat template, which no count
at the edge could match: where a usable provider of the model has one (llama.cpp,
vLLM, the mock: ``Operation.COUNT_TOKENS``), the run goes to it without taking a
slot or waiting in the queue, and the node asks the engine beside its generations.
Elsewhere the request runs once with ``max_tokens`` 1 and the answer is the prompt
tokens the provider counted. A provider that reports no usage gets an estimate
(``estimate_tokens``: about four bytes a token).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import Operation
from iop_edge.domain.usage import Api
from iop_edge.entrypoints.api_dialect import DialectRequest, dropped_tools_headers
from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.entrypoints.openai_errors import MethodNotAllowed
from iop_edge.errors import EdgeError
from iop_edge.formats.anthropic import (
    MessageStream,
    error_body,
    error_status,
    render_message,
)
from iop_edge.formats.anthropic_request import (
    chat_body,
    dropped_tools,
    estimate_tokens,
    prompt_body,
)
from iop_edge.ports import Catalog, RunSpec
from iop_proto import json_codec

if TYPE_CHECKING:
    from iop_edge.entrypoints.inference_routes import InferenceRoutes

MESSAGES_PATH: Final = "/v1/messages"
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"
MODELS_PATH: Final = "/v1/models"
CHAT: Final = Operation.CHAT_COMPLETIONS
ANTHROPIC_VERSION: Final = "anthropic-version"
"""The header every Anthropic client sends, which OpenAI's do not."""
REQUEST_ID: Final = "request-id"


def is_messages_path(path: str) -> bool:
    """A path of the Messages API, whose errors are Anthropic's whatever raised them."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


_ANTHROPIC_PREFIXES: Final = (MESSAGES_PATH, MODELS_PATH)
"""Where ``is_anthropic_request`` can be true: the paths it knows start with these."""


def is_anthropic_request(request: ApiRequest) -> bool:
    """A request answered in Anthropic's shapes: the Messages API, and the models
    asked for by an Anthropic client (Claude Code lists them to check its model)."""
    path = request.path
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):  # is_messages_path
        return True
    models = path == MODELS_PATH or path.startswith(MODELS_PATH + "/")
    return models and ANTHROPIC_VERSION in request.headers


async def mark_request_id(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``request-id`` on every Anthropic answer (the SDKs show it in errors and logs):
    the run's id where one was opened, else a new one.

    Every answer of the app passes here: most are on neither API's paths, told by
    their prefix before the full rule is asked."""
    if (
        not request.path.startswith(_ANTHROPIC_PREFIXES)
        or REQUEST_ID in response.headers
        or not is_anthropic_request(request)
    ):
        return
    run_id = response.headers.get("X-Request-Id") or uuid.uuid4().hex
    response.headers[REQUEST_ID] = "req_" + run_id


def messages_error_response(exc: EdgeError) -> web.Response:
    """An error before the first byte in Anthropic's shape, status and headers."""
    response = web.Response(
        status=error_status(exc),
        body=json_codec.dumps(error_body(exc)),
        content_type="application/json",
    )
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, MethodNotAllowed) and exc.allowed:
        response.headers["Allow"] = exc.allowed
    return response


class MessagesDialect:
    """Implements ``Dialect`` for ``POST /v1/messages``, streamed or not."""

    operation: Final = CHAT
    api: Final = Api.MESSAGES

    def read(self, body: dict[str, Any]) -> DialectRequest:
        chat = chat_body(body)
        stream = bool(chat.get("stream"))
        spec = RunSpec(
            model=chat["model"], operation=CHAT, body=chat, stream=stream, include_usage=stream
        )
        headers = dropped_tools_headers("messages", spec.model, dropped_tools(body))
        return DialectRequest(spec, context=tuple(chat.get("stop", ())), headers=headers)

    resolve: Final = None  # nothing stored to read: a Messages request carries its conversation

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> MessageStream:
        return MessageStream(message_id=f"msg_{run_id}", model=request.spec.model)

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        message = render_message(
            end,
            deltas,
            message_id=f"msg_{run_id}",
            model=request.spec.model,
            stop_sequences=request.context,
        )
        return json_codec.dumps(message)

    def error_response(self, exc: EdgeError) -> web.Response:
        return messages_error_response(exc)


class CountTokensDialect:
    """Implements ``Dialect`` for ``POST /v1/messages/count_tokens``: never streamed."""

    operation: Final = Operation.COUNT_TOKENS  # what the run log says, however it was counted
    api: Final = Api.MESSAGES

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def read(self, body: dict[str, Any]) -> DialectRequest:
        chat = prompt_body(body)
        operation = Operation.COUNT_TOKENS
        if not self._catalog.offers(chat["model"], operation):
            chat["max_tokens"] = 1  # no tokenizer to ask: a run that generates one token
            operation = CHAT
        spec = RunSpec(
            model=chat["model"], operation=operation, body=chat, stream=False, include_usage=False
        )
        return DialectRequest(spec, context=chat)

    resolve: Final = None

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> MessageStream:
        return MessageStream(message_id=f"msg_{run_id}", model=request.spec.model)  # unused

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        counted = _prompt_tokens(end, deltas)
        return json_codec.dumps({"input_tokens": counted or estimate_tokens(request.context)})

    def error_response(self, exc: EdgeError) -> web.Response:
        return messages_error_response(exc)


def _prompt_tokens(end: Completed, deltas: Sequence[Delta]) -> int:
    """The prompt tokens the provider reported (its result's usage first), 0 if none."""
    if end.result_json:
        try:
            result = json_codec.loads(end.result_json)
        except ValueError:
            result = None
        usage = result.get("usage") if isinstance(result, dict) else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(prompt, int) and prompt > 0:
            return prompt
    if end.usage is not None and end.usage.prompt_tokens > 0:
        return end.usage.prompt_tokens
    return next((d.usage.prompt_tokens for d in deltas if d.usage and d.usage.prompt_tokens), 0)


def register_messages(app: web.Application, routes: InferenceRoutes, catalog: Catalog) -> None:
    """``/v1/messages`` and ``/v1/messages/count_tokens`` over the shared pipeline, and
    ``request-id`` on every Anthropic answer."""
    app.router.add_post(MESSAGES_PATH, routes.route(MessagesDialect()))
    app.router.add_post(COUNT_TOKENS_PATH, routes.route(CountTokensDialect(catalog)))
    app.router.add_get("/", root)  # and HEAD: Claude Code's first request, a reachability probe
    app.on_response_prepare.append(mark_request_id)


async def root(request: web.Request) -> web.Response:
    """``GET``/``HEAD /``: the server is up (a 404 here reads as a wrong base URL)."""
    return web.json_response({"status": "ok"})
