"""Cross-origin requests (CORS), for the browser apps an operator names (``http.cors_origins``).

Off unless origins are configured: then nothing here runs on any request. With
origins, a browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``)
is answered here, before authentication and the loopback rule (a preflight
carries no credentials, by the Fetch standard), and every answer to an allowed
origin carries ``Access-Control-Allow-Origin``. The headers are added when a
response is prepared, so streamed answers (SSE) get them too, not only whole ones.
An origin not configured gets no CORS headers: the browser refuses the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

ALLOWED_METHODS: Final = "GET, POST, DELETE, OPTIONS"
EXPOSED_HEADERS: Final = "X-Request-Id"
PREFLIGHT_MAX_AGE_S: Final = 600
ANY_ORIGIN: Final = "*"


class CorsPolicy:
    """Which origins may call the API from a browser (``"*"``: any)."""

    def __init__(self, origins: Sequence[str]) -> None:
        self._any = ANY_ORIGIN in origins
        self._origins = frozenset(origin.rstrip("/") for origin in origins)

    def allowed(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for this request's origin, if any."""
        if not origin:
            return None
        if self._any:
            return ANY_ORIGIN
        return origin if origin in self._origins else None

    def install_preflight(self, middlewares: list[Middleware]) -> None:
        """Preflights are answered first: the outermost middleware."""
        middlewares.insert(0, self._preflight())

    def mark_responses(self, app: web.Application) -> None:
        """Every response to an allowed origin, streamed or whole, says so."""
        app.on_response_prepare.append(self._mark)

    def _preflight(self) -> Middleware:
        @web.middleware
        async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
            if (
                request.method != hdrs.METH_OPTIONS
                or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers
            ):
                return await handler(request)
            response = web.Response(status=204)
            if self.allowed(request.headers.get(hdrs.ORIGIN)) is not None:
                response.headers[hdrs.ACCESS_CONTROL_ALLOW_METHODS] = ALLOWED_METHODS
                requested = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS)
                if requested:  # Authorization, x-api-key, the SDKs' own headers...
                    response.headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = requested
                response.headers[hdrs.ACCESS_CONTROL_MAX_AGE] = str(PREFLIGHT_MAX_AGE_S)
            return response

        return preflight

    async def _mark(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        allowed = self.allowed(request.headers.get(hdrs.ORIGIN))
        if allowed is None:
            return
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = allowed
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = EXPOSED_HEADERS
        if allowed != ANY_ORIGIN:
            response.headers.add(hdrs.VARY, hdrs.ORIGIN)
