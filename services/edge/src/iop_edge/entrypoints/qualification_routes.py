"""The qualification reports' admin API (docs/ARCHITECTURE.md#qualification-reports),
for operator keys only (and the open API), like the fleet's history: a report tells of
every provider of a model.

- ``POST /iop/v1/qualifications``: store a report ``iopctl qualify`` made (201, its id);
- ``GET /iop/v1/qualifications[?model=]``: the reports' summaries, newest first;
- ``GET /iop/v1/qualifications/{id}``: one report whole;
- ``GET /iop/v1/catalog/qualifications[?model=]``: the catalog's view, the newest report
  of each provider of each model.
"""

from __future__ import annotations

from aiohttp import web

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.entrypoints.inference_request import read_json_body
from iop_edge.errors import InvalidRequest, NotFound, OperatorOnly
from iop_edge.ports import KeyRing
from iop_edge.service.qualifications import BadReport, QualificationBook

PATH = "/iop/v1/qualifications"
CATALOG_PATH = "/iop/v1/catalog/qualifications"


class QualificationRoutes:
    def __init__(self, book: QualificationBook, keys: KeyRing) -> None:
        self._book = book
        self._keys = keys

    def register(self, app: web.Application) -> None:
        app.router.add_post(PATH, self.add)
        app.router.add_get(PATH, self.listing)
        app.router.add_get(PATH + "/{report_id}", self.one)
        app.router.add_get(CATALOG_PATH, self.latest)

    def _operator(self, request: web.Request) -> ApiKeyEntry | None:
        key = authenticate(request, self._keys)
        if key is not None and not key.operator:
            raise OperatorOnly("Qualification reports are for operator keys only.")
        return key

    async def add(self, request: web.Request) -> web.Response:
        self._operator(request)
        document = await read_json_body(request)
        try:
            stored = await self._book.add(document)
        except BadReport as exc:
            raise InvalidRequest(f"Not a qualification report: {exc}.") from None
        return web.json_response(stored.summary(), status=201)

    async def listing(self, request: web.Request) -> web.Response:
        self._operator(request)
        return web.json_response({"data": await self._book.listing(_model(request))})

    async def latest(self, request: web.Request) -> web.Response:
        self._operator(request)
        return web.json_response({"data": await self._book.latest(_model(request))})

    async def one(self, request: web.Request) -> web.Response:
        self._operator(request)
        report_id = request.match_info["report_id"]
        stored = await self._book.get(report_id)
        if stored is None:
            raise NotFound(f"No qualification report {report_id!r}.")
        return web.json_response(stored.document())


def _model(request: web.Request) -> str | None:
    return request.query.get("model") or None
