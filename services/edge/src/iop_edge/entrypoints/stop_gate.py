"""The HTTP side of a graceful stop: once the edge drains, no new request starts.

The listening socket is closed first (new connections are refused by the OS);
this gate answers what still arrives on a connection kept alive from before:
an OpenAI 503 (Anthropic's 529 on the Messages API), and ``Connection: close`` so
the client reconnects elsewhere.
"""

from __future__ import annotations

from aiohttp import web

from iop_edge.entrypoints.messages_dialect import is_messages_path, messages_error_response
from iop_edge.entrypoints.openai_errors import error_response
from iop_edge.errors import ShuttingDown


class StopGate:
    """Open while the edge serves; ``close()`` when it starts draining."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def refusal(self, path: str) -> web.Response:
        """The answer to a request that arrives once closed (``api_gate`` asks first)."""
        refusal = ShuttingDown("The server is shutting down; retry later")
        if is_messages_path(path):
            response = messages_error_response(refusal)
        else:
            response = error_response(refusal)
        response.force_close()  # aiohttp then sends Connection: close
        return response
