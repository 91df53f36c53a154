"""The one place the edge's errors become HTTP: OpenAI's error object, status and headers.

Handlers and the dispatcher only raise the right ``EdgeError``; this module
decides what the client reads. Routing failures of aiohttp itself (unknown
path, wrong method, body too large) are translated into ``EdgeError``s here too,
so every error the API returns has the same shape the OpenAI SDKs parse.
"""

from __future__ import annotations

import json

from aiohttp import web

from iop_edge.entrypoints.api_request import ApiRequest
from iop_edge.errors import EdgeError, RequestTooLarge
from iop_edge.formats.errors import error_payload


class RouteNotFound(EdgeError, LookupError):
    """No route at this path (OpenAI answers ``Invalid URL (POST /v1/x)`` with a 404)."""

    status, type, code = 404, "invalid_request_error", "unknown_url"


class MethodNotAllowed(EdgeError):
    """The path exists, the method does not; ``allowed`` becomes the ``Allow`` header."""

    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    def __init__(self, message: str, *, allowed: str = "") -> None:
        super().__init__(message)
        self.allowed = allowed


def error_response(exc: EdgeError) -> web.Response:
    """The HTTP response for ``exc``: its status, the error object, ``Retry-After``, if any."""
    body = json.dumps(error_payload(exc), ensure_ascii=False, separators=(",", ":"))
    response = web.Response(status=exc.status, text=body, content_type="application/json")
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, MethodNotAllowed) and exc.allowed:
        response.headers["Allow"] = exc.allowed
    return response


def from_http_exception(request: ApiRequest, exc: web.HTTPException) -> EdgeError:
    """An aiohttp routing/body exception as the ``EdgeError`` the client should see."""
    where = f"{request.method} {request.path}"
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound(f"Invalid URL ({where})")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(
            f"Method {request.method} is not allowed for {request.path}",
            allowed=", ".join(sorted(exc.allowed_methods)),
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return RequestTooLarge(f"The request body is too large ({exc.text})")
    # Any other status aiohttp raises (rare): keep it, in the same error shape.
    error = EdgeError(exc.reason or where, code=None)
    error.status = exc.status
    error.type = "invalid_request_error" if exc.status < 500 else "server_error"
    return error
