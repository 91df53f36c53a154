"""The API's one middleware: what every request crosses before its route's handler.

In this order, each rule before the next: the stop gate (a draining edge answers
503 and closes the connection), then, inside the error boundary, the loopback
rule of an open edge, the body deadline, and the handler. One layer rather than
one per rule: the rules are fixed and few, and each is a plain check that lets
the request through; what a request crosses is read here top to bottom.
CORS preflights, when origins are configured, are answered before this
(``CorsPolicy``), without credentials, by the Fetch standard.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from loguru import logger

from iop_edge.entrypoints.api_auth import OPEN_PATHS, check_open_access, is_loopback
from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.entrypoints.messages_dialect import is_anthropic_request, messages_error_response
from iop_edge.entrypoints.openai_errors import error_response, from_http_exception
from iop_edge.entrypoints.stop_gate import StopGate
from iop_edge.errors import EdgeError, InvalidRequest, StorageUnavailable
from iop_edge.formats.errors import internal_error
from iop_edge.ports import KeyRing
from iop_proto.postgres import StorageUnavailable as StoreDown
from iop_proto.service.logging import log_unexpected

READ_TIMEOUT_S: Final = 30.0
"""A body is judged every this many seconds until complete (``http.read_timeout_s``)."""
MIN_BODY_RATE: Final = 16 * 1024
"""Bytes per second a body must keep arriving at: far above a trickle, far below any real
link (a 200 MB batch file needs less than four hours at this rate)."""


def api_gate(
    keys: KeyRing,
    *,
    allow_open: bool = False,
    stop_gate: StopGate | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
    min_body_rate: int = MIN_BODY_RATE,
) -> Middleware:
    """The middleware for ``keys``: see the module's docstring for what it checks
    (``ApiGate``'s arguments)."""
    return ApiGate(
        keys,
        allow_open=allow_open,
        stop_gate=stop_gate,
        read_timeout_s=read_timeout_s,
        min_body_rate=min_body_rate,
    ).middleware()


Answer = TypeVar("Answer")


class ApiGate:
    """The rules every request crosses, for either HTTP front (``api_request``): aiohttp's
    through ``middleware``, the inference front (``fast_front``) through ``serve``.

    ``allow_open``: serve every client while no keys are configured (by default, only
    loopback ones: ``check_open_access``; the probes, ``OPEN_PATHS``, serve anyone).
    ``stop_gate``: once closed, each request gets a 503 and its connection closes.
    ``read_timeout_s``, ``min_body_rate``: a client whose body, not yet complete, grew by
    less than ``min_body_rate`` bytes a second over ``read_timeout_s`` is cut
    (``_BodyWatchdog``; the header read timeout bounds the headers).
    """

    def __init__(
        self,
        keys: KeyRing,
        *,
        allow_open: bool = False,
        stop_gate: StopGate | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        min_body_rate: int = MIN_BODY_RATE,
    ) -> None:
        self._keys = keys
        self._allow_open = allow_open
        self.stop_gate = stop_gate if stop_gate is not None else StopGate()
        self._read_timeout_s = read_timeout_s
        self._min_body_rate = min_body_rate

    def middleware(self) -> Middleware:
        @web.middleware
        async def api_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.serve(request, functools.partial(handler, request))

        return api_gate

    async def serve(
        self, request: ApiRequest, handler: Callable[[], Awaitable[Answer]]
    ) -> Answer | web.StreamResponse:
        """``handler``'s answer to ``request``, or the gate's own (a refusal, an error)."""
        if self.stop_gate.closed:
            return self.stop_gate.refusal(request.path)
        try:
            # a loopback client is served whatever the rule says (is_loopback: cached)
            keys = self._keys
            remote = request.remote
            if keys.open and not is_loopback(remote) and request.path not in OPEN_PATHS:
                check_open_access(remote, keys, self._allow_open)
            if not request.body_exists or request.content.is_eof():
                return await handler()
            watchdog = _BodyWatchdog(request, self._read_timeout_s, self._min_body_rate)
            try:
                return await handler()
            finally:
                watchdog.cancel()
        except Exception as exc:  # CancelledError is no Exception: it passes through
            return _error_answer(request, exc)


def _error_answer(request: ApiRequest, exc: Exception) -> web.StreamResponse:
    """The error boundary: every error leaves as an OpenAI error object (an Anthropic
    one on the Messages API's paths: ``is_anthropic_request``).

    ``EdgeError``s, the shared store down (a retryable 503), aiohttp's own 4xx
    (unknown route, wrong method) are expected, and so is input aiohttp cannot
    parse while a handler reads it (a multipart part's malformed headers, a
    broken chunked body): that is the client's fault, a 400. Anything else is a
    bug, logged once with its traceback (bounded: ``log_unexpected``), answered 500.
    """
    respond = messages_error_response if is_anthropic_request(request) else error_response
    if isinstance(exc, EdgeError):
        return respond(exc)
    if isinstance(exc, StoreDown):
        # The shared store is down: a storage API's answer, retryable; inference does not
        # touch the store and is not affected. The cause is logged, not shown.
        logger.warning("{} {}: {}", request.method, request.path, exc)
        return respond(StorageUnavailable("The store is unavailable now; retry shortly."))
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc  # a redirect is not an error
        return respond(from_http_exception(request, exc))
    if isinstance(exc, HttpProcessingError | web.RequestPayloadError):
        detail = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
        return respond(InvalidRequest(f"The request could not be read: {detail[:200]}"))
    log_unexpected(exc, "unhandled error serving {} {}", request.method, request.path)
    return respond(internal_error())


class _BodyWatchdog:
    """Cuts a client whose body trickles in (slowloris): every ``window_s`` seconds
    until it is complete, a body must have grown by ``min_rate`` bytes a second.

    aiohttp bounds nothing once the headers are in: a handler awaiting the body
    would wait, holding a connection and a task, for as long as the client sends
    a byte now and then. A rate rather than one deadline for the whole body, so a
    large upload on a slow link still gets through (Apache's ``MinRate`` idea);
    a timer re-armed while the body keeps coming rather than ``asyncio.timeout``
    around the reads, because uploads are read part by part in their handler.
    When it cuts, it closes the connection, and the handler is cancelled like for
    any client that leaves.
    """

    def __init__(self, request: ApiRequest, window_s: float, min_rate: int) -> None:
        self._request = request
        self._window_s = window_s
        self._min_bytes = window_s * min_rate
        self._seen = request.content.total_bytes
        self._timer = asyncio.get_running_loop().call_later(window_s, self._check)

    def cancel(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        request, content = self._request, self._request.content
        if content.is_eof() or request.transport is None:
            return  # all of it arrived (maybe not read yet), or the client is gone already
        if content.total_bytes - self._seen >= self._min_bytes:
            self._seen = content.total_bytes
            self._timer = asyncio.get_running_loop().call_later(self._window_s, self._check)
            return
        logger.warning(
            "cut {} {} from {}: its body arrived slower than {} bytes in {:g}s",
            request.method,
            request.path,
            request.remote,
            int(self._min_bytes),
            self._window_s,
        )
        request.transport.close()
