"""``GET /iop/v1/history``: the fleet's requests, TTFT, tokens/s, queue depth and errors
per model and provider over a time range (``service.history``), for the console's plots.

Behind the API key as ``/iop/v1/runs`` and ``/iop/v1/usage`` are (the open API serves it
where the gate lets a caller in at all), and for operators only: the series are every
key's traffic, which a key that is not an operator's may not see (403).

Parameters, all optional, integers: ``since_ms`` and ``until_ms`` (Unix ms, the range
``[since, until)``, by default the trailing 15 minutes) and ``step_ms`` (the bucket,
by default 10 s; at most ``MAX_BUCKETS`` of them).
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

from iop_edge.domain.history import HistoryRangeError
from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.errors import InvalidRequest, OperatorOnly
from iop_edge.ports import KeyRing
from iop_edge.service.history import HistoryReport

HISTORY_PATH = "/iop/v1/history"


class HistoryRoutes:
    """The history endpoint over one ``HistoryReport``."""

    def __init__(self, report: HistoryReport, keys: KeyRing) -> None:
        self._report = report
        self._keys = keys

    def register(self, app: web.Application) -> None:
        app.router.add_get(HISTORY_PATH, self.history)

    async def history(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        if key is not None and not key.operator:
            raise OperatorOnly("The fleet's history is for operator keys only.")
        query = request.query
        try:
            span = self._report.span(
                _integer(query.get("since_ms"), "since_ms"),
                _integer(query.get("until_ms"), "until_ms"),
                _integer(query.get("step_ms"), "step_ms"),
            )
        except HistoryRangeError as exc:
            raise InvalidRequest(str(exc), param=exc.param) from exc
        return web.json_response(await self._report.view(span))


_LARGEST: Final = 2**53
"""Above any time in milliseconds a run log holds, and within what both stores' integers
(SQLite's and PostgreSQL's 64-bit ones) and the page's JSON numbers carry exactly."""


def _integer(raw: str | None, param: str) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"'{param}' must be an integer.", param=param) from None
    if not 0 <= value <= _LARGEST:
        raise InvalidRequest(f"'{param}' must be between 0 and {_LARGEST}.", param=param)
    return value
