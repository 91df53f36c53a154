"""The inference pipeline: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``
(and every API written as a ``Dialect``, see ``api_dialect``).

One request: authenticate, parse the body once, let the dialect read it,
resolve the model, admit its run under a slot of the key and open it, then relay
the run's events (as SSE events the moment each arrives, or as one JSON body
at the end), in the dialect's wire.

The request's run exists from admission (``RunService.admit``, before any wait) to
its one outcome, and every way the request ends goes through it: a client that
disconnects (the handler is cancelled, or a write fails) ends it here, which cancels
it on the node; a key revoked meanwhile ends it from ``KeySlots``, with a 401 (or
an error event once the stream has started). Exactly one ``EdgeRunRecord`` is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable, MutableMapping
from typing import Any, Final, Protocol, TypeVar, cast

from aiohttp import web
from aiohttp.typedefs import Handler
from loguru import logger

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_edge.domain.key_rates import Gauge
from iop_edge.entrypoints.api_auth import KeySlots, authenticate
from iop_edge.entrypoints.api_dialect import Dialect, DialectRequest, StreamWriter
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.entrypoints.inference_request import read_json_body
from iop_edge.entrypoints.openai_dialect import OpenAIDialect
from iop_edge.entrypoints.rate_headers import anthropic_headers, openai_headers
from iop_edge.entrypoints.routing_hints import routing_hints
from iop_edge.entrypoints.run_span import open_span
from iop_edge.entrypoints.run_trace import OVERHEAD_HEADER, RunTrace
from iop_edge.errors import (
    EdgeError,
    ModelNotAllowed,
    ModelNotFound,
    ProviderFailed,
)
from iop_edge.formats.errors import internal_error
from iop_edge.ports import Catalog, KeyRing, RunEvents, RunLog, RunService
from iop_edge.service.key_rates import KeyRates, Meter, limited
from iop_edge.service.limits import CLAMP_HEADER, bound_answer
from iop_edge.service.run_reader import Collector, follow
from iop_proto.service.logging import log_unexpected
from iop_proto.tracing import Tracing, trace_id, traceparent

CLIENT_DISCONNECTED: Final = "client disconnected"


class StreamOut(Protocol):
    """Where a streamed run's bytes go: an HTTP ``web.StreamResponse`` (SSE), or another
    carrier of the same events (the Responses API's WebSocket mode)."""

    @property
    def prepared(self) -> bool: ...

    @property
    def headers(self) -> MutableMapping[str, str]: ...

    async def prepare(self, request: Any) -> Any:
        """Send the status line and headers (``request``: the one answered; aiohttp's
        ``StreamResponse`` takes its ``web.BaseRequest``)."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None: ...


Out = TypeVar("Out", bound=StreamOut)


class HotRoute(Protocol):
    """An inference endpoint as the inference front (``fast_front``) calls it: the request,
    and where its stream goes; the answer is that stream (written), or a whole response."""

    def __call__(
        self, request: ApiRequest, *, out: StreamOut
    ) -> Awaitable[StreamOut | web.StreamResponse]: ...


HotRoutes = dict[str, HotRoute]


SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not hold tokens back either
}


class InferenceRoutes:
    """The inference endpoints over one ``RunService``, one ``Dialect`` per API."""

    def __init__(
        self,
        service: RunService,
        catalog: Catalog,
        keys: KeyRing,
        runlog: RunLog,
        metrics: ApiMetrics,
        slots: KeySlots,
        rates: KeyRates,
        *,
        mock_drills: bool = False,
        tracing: Tracing | None = None,
    ) -> None:
        """``mock_drills``: honour the mock's failure drills from every caller, not only
        operator keys (domain/drills.py). ``tracing``: a span per request (run_span);
        ``None``: tracing off, no span made."""
        self._service = service
        self._catalog = catalog
        self._keys = keys
        self._runlog = runlog
        self._metrics = metrics
        self._slots = slots
        self._rates = rates
        self._mock_drills = mock_drills
        self._tracing = tracing

    def register(self, app: web.Application, hot: HotRoutes | None = None) -> None:
        """The endpoints on ``app``; in ``hot`` too, for the inference front (``fast_front``)."""
        for path, operation in OPENAI_PATHS.items():
            dialect = OpenAIDialect(operation)
            app.router.add_post(path, self.route(dialect))
            if hot is not None:
                hot[path] = functools.partial(self._serve, dialect=dialect)

    def route(self, dialect: Dialect) -> Handler:
        """The handler of one API's endpoint: this pipeline in ``dialect``'s wire."""
        # with no ``out`` every answer is aiohttp's: a stream is a ``StreamResponse`` of its own
        return cast(Handler, functools.partial(self._serve, dialect=dialect))

    async def _serve(
        self, request: ApiRequest, dialect: Dialect, out: StreamOut | None = None
    ) -> StreamOut | web.StreamResponse:
        """Answer one request and account for it, on every path out (``out``: where a
        stream goes; ``None``: an aiohttp ``StreamResponse`` of its own)."""
        trace = RunTrace(dialect.operation, dialect.api)
        try:
            key = authenticate(request, self._keys)
            if key is not None:
                trace.key_id = key.key_id
                self._slots.check_room(key)  # a key at its limit costs no body parsing
            body = await read_json_body(request)
            return await self._run(request, dialect, trace, key, body, out)
        except EdgeError as exc:
            trace.failed(exc, status=exc.status)
            response = dialect.error_response(exc)
            response.headers["X-Request-Id"] = trace.request_id
            response.headers[OVERHEAD_HEADER] = trace.overhead()
            response.headers.update(trace.headers)
            return response
        except asyncio.CancelledError:
            trace.client_gone()
            raise
        except Exception:
            trace.crashed()  # the middleware logs it and answers 500
            raise
        finally:
            # On the next loop pass: a whole answer leaves as this handler returns (the
            # front writes it in the same step), so the client does not wait for the
            # record and the metrics; the request's outcome is settled already.
            asyncio.get_running_loop().call_soon(trace.account, self._metrics, self._runlog)

    async def serve_stream(
        self,
        request: ApiRequest,
        dialect: Dialect,
        body: dict[str, Any],
        key: ApiKeyEntry | None,
        out: StreamOut,
    ) -> None:
        """One streamed run for a caller already authenticated (``key``), its events
        written to ``out``: the pipeline of ``route`` but for the transport. An error
        before the first byte is raised (an ``EdgeError``) for the caller to answer in
        its own framing; the run is accounted for on every path, as ``route``'s are."""
        trace = RunTrace(dialect.operation, dialect.api)
        if key is not None:
            trace.key_id = key.key_id
        try:
            await self._run(request, dialect, trace, key, body, out)
        except EdgeError as exc:
            trace.failed(exc, status=exc.status)
            raise
        except asyncio.CancelledError:
            trace.client_gone()
            raise
        except Exception:
            trace.crashed()
            raise
        finally:
            trace.account(self._metrics, self._runlog)

    async def _run(
        self,
        request: ApiRequest,
        dialect: Dialect,
        trace: RunTrace,
        key: ApiKeyEntry | None,
        body: dict[str, Any],
        out: Out | None,
    ) -> Out | web.StreamResponse:
        """``out``: where a stream goes (``None``: an SSE answer of its own)."""
        asked = dialect.read(body)
        if dialect.resolve is not None:
            asked = await dialect.resolve(asked, key)
        trace.headers.update(asked.headers)  # the dialect's, on every answer from here on
        spec = asked.spec
        trace.stream = spec.stream
        if key is not None and not key.allows(spec.model):
            # Checked before the catalog: a restricted key cannot probe which models exist.
            raise ModelNotAllowed(
                f"This API key is not allowed to use the model '{spec.model}'.", param="model"
            )
        entry = self._catalog.model(spec.model)
        if entry is None:
            raise ModelNotFound(f"The model '{spec.model}' does not exist.", param="model")
        trace.model = spec.model
        trace.series = self._metrics.models[spec.model]
        # What the pipeline adds to the dialect's run, made into one new spec at the end.
        changes: dict[str, Any] = {}
        if self._tracing is not None:
            trace.span = open_span(
                self._tracing,
                operation=spec.operation.value,
                model=spec.model,
                stream=spec.stream,
                received_ms=trace.received_ms,
            )
            changes["traceparent"] = traceparent(trace.span)
        changes.update(
            routing_hints(key, request.headers, body, spec.body, mock_drills=self._mock_drills)
        )
        chat, clamp = bound_answer(
            spec.operation,
            spec.body,
            entry.max_output_tokens,
            cap_when_unasked=entry.context_window > 0,
        )
        if chat is not spec.body:
            changes["body"] = chat
        if clamp is not None:
            trace.headers[CLAMP_HEADER] = clamp.header
        if changes:
            spec = dataclasses.replace(spec, **changes)
            asked = dataclasses.replace(asked, spec=spec)
        meter: Meter | None = None
        if key is not None and limited(key) and spec.operation in RATED:
            # Before the run is admitted: a refused request never takes a queue place.
            meter = await self._rates.admit(key, spec.model, spec.body)
            trace.headers.update(rate_headers(request, meter.gauges))
            if meter.refused is not None:
                raise meter.refused
        try:
            if trace.span is None:
                return await self._admitted(request, dialect, trace, key, asked, out, meter)
            # a traced request's log lines name its trace (the run log joins it to the run)
            with logger.contextualize(trace_id=trace_id(trace.span)):
                return await self._admitted(request, dialect, trace, key, asked, out, meter)
        finally:
            if meter is not None:
                meter.settle(trace.prompt_tokens, trace.completion_tokens, trace.run is not None)
                await meter.close()

    async def _admitted(
        self,
        request: ApiRequest,
        dialect: Dialect,
        trace: RunTrace,
        key: ApiKeyEntry | None,
        asked: DialectRequest,
        out: Out | None,
        meter: Meter | None,
    ) -> Out | web.StreamResponse:
        """Run an admitted request: its run under the key's slot, streamed or collected."""
        spec = asked.spec
        series = trace.series if trace.series is not None else self._metrics.models[spec.model]
        run = self._service.admit(spec)
        try:
            # A request without a key (an open API) holds no key's slot; the in-flight
            # gauge is its own context manager: one more for the block.
            held = self._slots.hold(key, run) if key is not None else _NO_KEY
            async with held:
                with series.in_flight:
                    opened_at = time.monotonic()
                    await run.open()  # the run ends itself on a failure here
                    trace.edge_wait_s = time.monotonic() - opened_at  # the model's queue
                    trace.run, trace.run_id = run, run.run_id
                    if spec.stream:
                        response = web.StreamResponse(headers=SSE_HEADERS) if out is None else out
                        return await self._stream(
                            request, dialect, asked, run, trace, response, meter
                        )
                    return await self._collect(dialect, asked, run, trace)
        except BaseException as exc:
            if not run.ended:
                reason = (
                    CLIENT_DISCONNECTED
                    if isinstance(exc, asyncio.CancelledError | ConnectionResetError)
                    else f"edge failed: {type(exc).__name__}"
                )
                # shielded: a second cancellation cannot keep the node running it
                await asyncio.shield(run.cancel(reason))
            raise

    async def _stream(
        self,
        request: ApiRequest,
        dialect: Dialect,
        asked: DialectRequest,
        run: RunEvents,
        trace: RunTrace,
        response: Out,
        meter: Meter | None = None,
    ) -> Out:
        """Relay the run as SSE, each event as it arrives; the status line waits for the
        first delta, so a run that fails before producing anything still gets a real
        HTTP error. Deltas that arrived together (one frame batch from the node) leave
        as one HTTP chunk: nothing is held back that could go out now."""
        response.headers["X-Request-Id"] = run.run_id
        response.headers.update(trace.headers)
        writer = dialect.stream_writer(asked, run.run_id, trace.created)
        sink = _SseSink(request, response, writer, trace, meter)
        try:
            end = await follow(run, sink)
            pending = sink.pending
            if isinstance(end, Completed):
                trace.completed(end)
                if not response.prepared:
                    trace.status = 200
                    response.headers[OVERHEAD_HEADER] = trace.overhead(end.provider_us)
                    await response.prepare(request)
                    if writer.opening is not None:
                        pending.append(writer.opening())
                closing = writer.closing(end)
                # What the last events say is stored is committed before they leave.
                if writer.settle is not None:
                    try:
                        await writer.settle()
                    except EdgeError as unsettled:
                        # Not stored (the store down): the stream must not say it was, so
                        # it ends with why instead of its closing events.
                        trace.failed(unsettled, status=200)
                        await response.write(b"".join(pending))
                        await _end_with_error(response, writer, unsettled)
                        return response
                pending.append(closing)
                # the last chunk and the stream's end leave together: one write, one packet
                await response.write_eof(b"".join(pending))
                return response
            if end is None:
                error: EdgeError = ProviderFailed("the run ended without a result")
            else:
                trace.provider_s = end.provider_us / 1_000_000
                if pending:
                    await response.write(b"".join(pending))
                error = run.error(end)
            if not response.prepared:
                raise error
            trace.failed(error, status=200)
            await _end_with_error(response, writer, error)
        except ConnectionResetError:
            # The client left between two tokens; aiohttp ignores the closed transport.
            trace.client_gone()
            await asyncio.shield(run.cancel(CLIENT_DISCONNECTED))
        except Exception as exc:
            if not response.prepared:
                raise  # the boundary can still answer with a 500
            # The status line is out: the outermost boundary could only write a second
            # response into this stream, so the stream itself ends the way a failed run's does.
            log_unexpected(exc, "streaming run {} failed in the edge", run.run_id)
            trace.crashed(status=200)
            await asyncio.shield(run.cancel(f"edge failed: {type(exc).__name__}"))
            with contextlib.suppress(ConnectionResetError):
                await _end_with_error(response, writer, internal_error())
        return response

    async def _collect(
        self,
        dialect: Dialect,
        asked: DialectRequest,
        run: RunEvents,
        trace: RunTrace,
    ) -> web.Response:
        """Wait for the run's end and answer with the whole result."""
        collector = Collector(trace)
        end = await follow(run, collector)
        if isinstance(end, Completed):
            trace.completed(end)
            body = await dialect.answer(asked, end, collector.deltas, trace.run_id, trace.created)
            trace.status = 200
            return web.Response(
                body=body,
                content_type="application/json",
                headers={
                    "X-Request-Id": run.run_id,
                    OVERHEAD_HEADER: trace.overhead(end.provider_us),
                    **trace.headers,
                },
            )
        if end is None:
            raise ProviderFailed("the run ended without a result")
        trace.provider_s = end.provider_us / 1_000_000
        raise run.error(end)


class _SseSink:
    """Writes deltas as SSE events the moment each arrives: those that arrived together
    (one frame batch from the node) leave as one HTTP chunk."""

    __slots__ = (
        "_meter",
        "_request",
        "_response",
        "_trace",
        "_write_delta",
        "_writer",
        "pending",
    )

    def __init__(
        self,
        request: ApiRequest,
        response: StreamOut,
        writer: StreamWriter,
        trace: RunTrace,
        meter: Meter | None = None,
    ) -> None:
        self._request = request
        self._meter = meter  # a limited key's: each delta counts as an output token
        self._response = response
        self._trace = trace
        self._writer = writer
        self._write_delta = writer.delta  # the writer is fixed for the stream
        self.pending: list[bytes] = []

    def restart(self) -> None:
        """Nothing to drop: a stream fails over only before its first delta, and that
        delta is what sends the status line (``_first``)."""

    def delta(self, event: Delta, more: bool) -> Awaitable[None] | None:
        response = self._response
        if not response.prepared:
            return self._first(event, more)  # which comes back here, prepared
        if self._meter is not None:
            self._meter.output()
        pending = self.pending
        pending.append(self._write_delta(event))
        if more:
            return None
        data = b"".join(pending)
        pending.clear()
        return response.write(data)

    async def _first(self, event: Delta, more: bool) -> None:
        """The first delta sends the status line (a run failing before it gets a real
        HTTP error instead)."""
        trace = self._trace
        trace.first_delta_at = time.monotonic()  # a stream's first delta comes here once
        trace.status = 200
        self._response.headers[OVERHEAD_HEADER] = trace.overhead(event.provider_us)
        await self._response.prepare(self._request)
        if self._writer.opening is not None:
            self.pending.append(self._writer.opening())
        write = self.delta(event, more)
        if write is not None:
            await write


async def _end_with_error(response: StreamOut, writer: StreamWriter, error: EdgeError) -> None:
    """An error after the first byte: the dialect's error events (OpenAI: an SSE error
    event, then ``[DONE]``)."""
    data = writer.failure(error)
    if writer.settle is not None:
        await writer.settle()
    await response.write_eof(data)


CHAT: Final = Operation.CHAT_COMPLETIONS
RATED: Final = frozenset({CHAT, Operation.COMPLETIONS, Operation.EMBEDDINGS})
"""The operations a key's rates and budget count (counting tokens runs no model)."""


def rate_headers(request: ApiRequest, gauges: tuple[Gauge, ...]) -> dict[str, str]:
    """The limiter's standing in the headers of the API the request came on."""
    if request.path.startswith("/v1/messages"):
        return anthropic_headers(gauges)
    return openai_headers(gauges)


OPENAI_PATHS: Final = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": Operation.COMPLETIONS,
    "/v1/embeddings": Operation.EMBEDDINGS,
}
_NO_KEY: Final = contextlib.nullcontext()
