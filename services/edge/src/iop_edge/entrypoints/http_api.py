"""The edge's public HTTP API: the OpenAI-compatible ``/v1`` and IOP's read-only additions.

``create_api_app`` builds the aiohttp application from the ports; ``bootstrap``
owns the runner. The inference endpoints live in ``inference_routes``; this
module holds the small read-only routes; ``api_gate`` the one middleware.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from importlib import resources
from typing import Any, Final

from aiohttp import web

from iop_edge.domain.fleet import ApiKeyEntry, ModelEntry
from iop_edge.entrypoints.api_auth import KeySlots, authenticate
from iop_edge.entrypoints.api_gate import MIN_BODY_RATE, READ_TIMEOUT_S, ApiGate
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.batch_routes import BatchRoutes
from iop_edge.entrypoints.cors import CorsPolicy
from iop_edge.entrypoints.fast_front import ApiFront
from iop_edge.entrypoints.history_routes import HistoryRoutes
from iop_edge.entrypoints.inference_routes import HotRoutes, InferenceRoutes
from iop_edge.entrypoints.messages_dialect import (
    is_anthropic_request,
    register_messages,
)
from iop_edge.entrypoints.qualification_routes import QualificationRoutes
from iop_edge.entrypoints.responses_routes import ResponsesRoutes
from iop_edge.entrypoints.stop_gate import StopGate
from iop_edge.entrypoints.usage_routes import UsageRoutes
from iop_edge.errors import InvalidRequest, ModelNotFound, TooManyConnections
from iop_edge.formats import anthropic
from iop_edge.formats.errors import error_payload
from iop_edge.formats.reasoning_seal import ReasoningSeal
from iop_edge.ports import Catalog, KeyRing, ResponseStore, RunLog, RunService
from iop_edge.service.batches import BatchService
from iop_edge.service.history import HistoryReport
from iop_edge.service.key_rates import KeyRates
from iop_edge.service.limits import DEFAULT_MAX_BODY_BYTES
from iop_edge.service.memory_key_rates import MemoryKeyRates
from iop_edge.service.qualifications import QualificationBook
from iop_edge.service.usage import UsageReport
from iop_proto.service.http_site import canned_response
from iop_proto.tracing import Tracing

MAX_BODY_BYTES: Final = DEFAULT_MAX_BODY_BYTES
"""Chat requests carry base64 images and long contexts: aiohttp's 1 MiB default is too small.
The limit follows from the node link's frame limit (``iop_edge.service.limits``): what is read here
can be carried to a node; ``bootstrap`` derives it from the ``max_frame_size`` setting."""
API_FRONT: Final = web.AppKey("api_front", ApiFront)
"""The app's inference front (``fast_front``): ``bootstrap`` serves the public port through it."""
RUNS_DEFAULT_LIMIT: Final = 50
RUNS_MAX_LIMIT: Final = 1000


def load_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document shipped in the package (read once, by ``bootstrap``)."""
    text = resources.files("iop_edge.entrypoints").joinpath("openapi.json").read_text("utf-8")
    document: dict[str, Any] = json.loads(text)
    return document


def connection_limit_refusal(max_connections: int) -> bytes:
    """What a client connecting over ``http.max_connections`` is answered: a whole 503 with
    OpenAI's error object and ``Retry-After``, made once (``CappedSite``'s refusal)."""
    error = TooManyConnections(
        f"The API is serving as many connections as it may ({max_connections}); retry shortly."
    )
    body = json.dumps(error_payload(error), separators=(",", ":")).encode()
    return canned_response(503, "Service Unavailable", body, "application/json")


def create_api_app(
    service: RunService,
    catalog: Catalog,
    keys: KeyRing,
    runlog: RunLog,
    metrics: ApiMetrics,
    *,
    openapi: dict[str, Any],
    max_body_bytes: int = MAX_BODY_BYTES,
    batches: BatchService | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
    key_slots: KeySlots | None = None,
    key_rates: KeyRates | None = None,
    allow_open: bool = False,
    min_body_rate: int = MIN_BODY_RATE,
    stop_gate: StopGate | None = None,
    cors_origins: Sequence[str] = (),
    responses: ResponseStore | None = None,
    reasoning_seal: ReasoningSeal | None = None,
    mock_drills: bool = False,
    tracing: Tracing | None = None,
    usage: UsageReport | None = None,
    qualifications: QualificationBook | None = None,
) -> web.Application:
    """The API application; serve it with ``web.AppRunner(app, handler_cancellation=True)``,
    through ``app[API_FRONT]``'s protocol for the inference routes (``bootstrap``).

    ``handler_cancellation=True`` is required, not a tuning knob: it is how
    aiohttp tells a handler that its client disconnected while nothing was being
    written (queued in ``open_run``, waiting for the first token or for a
    non-streaming result). Without it the handler only learns at its next write,
    and a run whose client is gone keeps a provider slot until it finishes.

    ``batches``: when given, ``/v1/files`` and ``/v1/batches`` are served too.
    ``read_timeout_s``: a client whose body, not yet complete, grew by less than
    ``min_body_rate`` bytes a second over that long is cut (``api_gate``;
    the runner's ``keepalive_timeout`` bounds the headers).
    ``key_slots``: the requests in progress per key, which the fleet updates end
    when their key is revoked (``bootstrap`` shares it; default: a new one).
    ``key_rates``: where keys' rates and budgets are counted (``bootstrap`` picks the
    store; default: this edge's memory).
    ``allow_open``: serve every client while no keys are configured (by default,
    only loopback ones: ``check_open_access``).
    ``min_body_rate``: bytes a second a body still arriving must grow by (``api_gate``).
    ``stop_gate``: once closed (the edge drains), each request gets a 503 and its
    connection closes; it is ``api_gate``'s first check, after CORS preflights only.
    ``cors_origins``: browser origins allowed to call the API (``CorsPolicy``); none
    by default, and then no CORS code runs.
    ``responses``: when given, the Responses API (``/v1/responses``) is served, its
    answers stored there.
    ``reasoning_seal``: seals the reasoning a Responses client keeps as
    ``encrypted_content`` (default: a new random key, opened by this app only).
    ``mock_drills``: the mock's failure drills from every caller, not operator keys only.
    ``tracing``: a span per inference request (docs/ARCHITECTURE.md#traces); ``None``: off.
    ``usage``: when given, each key's usage against its limits at ``/iop/v1/usage``.
    """
    gate = ApiGate(
        keys,
        allow_open=allow_open,
        stop_gate=stop_gate,
        read_timeout_s=read_timeout_s,
        min_body_rate=min_body_rate,
    )
    middlewares = [gate.middleware()]
    cors = CorsPolicy(cors_origins) if cors_origins else None
    if cors is not None:
        cors.install_preflight(middlewares)
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    if cors is not None:
        cors.mark_responses(app)
    slots = key_slots if key_slots is not None else KeySlots()
    rates = key_rates if key_rates is not None else KeyRates(MemoryKeyRates())
    inference = InferenceRoutes(
        service,
        catalog,
        keys,
        runlog,
        metrics,
        slots,
        rates,
        mock_drills=mock_drills,
        tracing=tracing,
    )
    hot: HotRoutes = {}
    inference.register(app, hot)
    app[API_FRONT] = ApiFront(
        gate,
        hot,
        max_body_bytes=max_body_bytes,
        header_timeout_s=read_timeout_s,
        cors=cors is not None,
    )
    register_messages(app, inference, catalog)
    if responses is not None:
        seal = reasoning_seal if reasoning_seal is not None else ReasoningSeal.generate()
        ResponsesRoutes(responses, keys, seal, max_body_bytes).register(app, inference)
    ReadRoutes(catalog, keys, runlog, openapi).register(app)
    HistoryRoutes(HistoryReport(runlog), keys).register(app)
    if batches is not None:
        BatchRoutes(batches, keys).register(app)
    if usage is not None:
        UsageRoutes(usage, keys).register(app)
    if qualifications is not None:  # docs/ARCHITECTURE.md#qualification-reports
        QualificationRoutes(qualifications, keys).register(app)
    return app


class ReadRoutes:
    """Models, the IOP catalog, recent runs, health, readiness and the OpenAPI document."""

    def __init__(
        self, catalog: Catalog, keys: KeyRing, runlog: RunLog, openapi: dict[str, Any]
    ) -> None:
        self._catalog = catalog
        self._keys = keys
        self._runlog = runlog
        self._openapi = json.dumps(openapi, separators=(",", ":")).encode()

    def register(self, app: web.Application) -> None:
        router = app.router
        router.add_get("/v1/models", self.list_models)
        # Model ids contain ':' and '/' (``llama3.1:8b``, ``org/model``).
        router.add_get("/v1/models/{model_id:.+}", self.retrieve_model)
        router.add_get("/iop/v1/catalog/providers", self.catalog_providers)
        router.add_get("/iop/v1/catalog/models", self.catalog_models)
        router.add_get("/iop/v1/runs", self.runs)
        router.add_get("/healthz", self.healthz)
        router.add_get("/readyz", self.readyz)
        router.add_get("/openapi.json", self.openapi)

    async def list_models(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        if is_anthropic_request(request):
            return web.json_response(anthropic_model_list(self._catalog.models(), key))
        data = [model_object(m) for m in self._catalog.models() if _visible(key, m.id)]
        return web.json_response({"object": "list", "data": data})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        model_id = request.match_info["model_id"]
        entry = self._catalog.model(model_id) if _visible(key, model_id) else None
        if entry is None:
            # A model outside the key's list is as absent as one that does not exist.
            raise ModelNotFound(f"The model '{model_id}' does not exist.", param="model")
        if is_anthropic_request(request):
            return web.json_response(anthropic.model_info(entry.id, entry.display_name))
        return web.json_response(model_object(entry))

    async def catalog_providers(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        return web.json_response({"data": self._catalog.provider_views(key)})

    async def catalog_models(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        return web.json_response({"data": self._catalog.model_views(key)})

    async def runs(self, request: web.Request) -> web.Response:
        """Recent runs: a key sees its own; an operator key (and the open API) every run."""
        key = authenticate(request, self._keys)
        limit = _limit(request.query.get("limit"))
        own = None if key is None or key.operator else key.key_id
        records = await self._runlog.recent(limit, key_id=own)
        return web.json_response({"data": [asdict(record) for record in records]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self._catalog.any_available():
            return web.json_response({"status": "ready"})
        return web.json_response(
            {"status": "not_ready", "reason": "no provider is available"}, status=503
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")


def model_object(entry: ModelEntry) -> dict[str, Any]:
    """OpenAI's model object, with IOP's display name and the model's limits under the
    names clients read (docs/ARCHITECTURE.md#model-limits): the output cap always, the
    context window when the fleet file gives it."""
    model: dict[str, Any] = {
        "id": entry.id,
        "object": "model",
        "created": 0,
        "owned_by": "iop",
        "display_name": entry.display_name,
        "max_output_tokens": entry.max_output_tokens,
        "max_output_length": entry.max_output_tokens,
    }
    if entry.context_window:
        model["context_window"] = model["context_length"] = entry.context_window
    return model


def anthropic_model_list(models: Sequence[ModelEntry], key: ApiKeyEntry | None) -> dict[str, Any]:
    """The models in Anthropic's shape, for a client that sent ``anthropic-version``."""
    infos = [anthropic.model_info(m.id, m.display_name) for m in models if _visible(key, m.id)]
    return anthropic.model_list(infos)


def _visible(key: ApiKeyEntry | None, model_id: str) -> bool:
    return key is None or key.allows(model_id)


def _limit(raw: str | None) -> int:
    if raw is None:
        return RUNS_DEFAULT_LIMIT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= RUNS_MAX_LIMIT:
        raise InvalidRequest(
            f"'limit' must be an integer from 1 to {RUNS_MAX_LIMIT}.", param="limit"
        )
    return value
