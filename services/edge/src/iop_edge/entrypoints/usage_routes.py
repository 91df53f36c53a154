"""``GET /iop/v1/usage``: each key's usage against its limits (``service.usage``).

Behind the API key, as the catalog and the run history are: an operator key (and the
open API) sees every key, and may name one (``?key=`` its id or name); any other key
sees its own usage only, and another key's name is answered 404, as if it did not exist.
"""

from __future__ import annotations

from aiohttp import web

from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.ports import KeyRing
from iop_edge.service.usage import UsageReport

USAGE_PATH = "/iop/v1/usage"


class UsageRoutes:
    """The usage endpoint over one ``UsageReport``."""

    def __init__(self, report: UsageReport, keys: KeyRing) -> None:
        self._report = report
        self._keys = keys

    def register(self, app: web.Application) -> None:
        app.router.add_get(USAGE_PATH, self.usage)

    async def usage(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        asked = request.query.get("key") or None
        return web.json_response(await self._report.views(key, asked))
