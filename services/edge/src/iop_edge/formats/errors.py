"""OpenAI's error object for an ``EdgeError``: the body of an error response, of an SSE
error event mid-stream and of a failed batch line alike."""

from __future__ import annotations

from typing import Any

from iop_edge.errors import EdgeError


def internal_error() -> EdgeError:
    """What the client reads about a bug: nothing of its internals (those are logged)."""
    return EdgeError(
        "The server had an error while processing your request.", code="internal_error"
    )


def error_payload(exc: EdgeError) -> dict[str, Any]:
    """OpenAI's error object; also the body of an SSE error event sent mid-stream."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }
