"""The console's routes: one static page and its script and stylesheet, nothing else.

The page holds no data and no key. Its script reads the documented, key-protected
endpoints (``/iop/v1/catalog/providers``, ``/iop/v1/catalog/models``,
``/iop/v1/runs``, ``/iop/v1/usage``) with the key the operator typed, so the console is exactly as
protected as the API and can never show more than the API would. The page itself
is not behind the key because a browser cannot send a Bearer header when it
navigates; there is nothing in it to protect.

Every URL the page uses is relative (``console/static/...``, ``v1/catalog/...``),
so the console keeps working when a reverse proxy mounts the edge under a prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Final

from aiohttp import web

CONSOLE_PATH: Final = "/iop/console"
STATIC_PATH: Final = f"{CONSOLE_PATH}/static"

_CONTENT_TYPES: Final = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
}
# Same-origin only: the console must work offline and load nothing from a CDN, and
# the policy makes a stray external reference fail loudly instead of silently.
_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Asset names carry no version: after an upgrade the browser must revalidate
    # (cheap, with the ETag) rather than run an old script against a new API.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True, slots=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str

    def response(self, request: web.Request) -> web.Response:
        headers = {**_HEADERS, "ETag": self.etag}
        if self.etag in _etags(request.headers.get("If-None-Match", "")):
            return web.Response(status=304, headers=headers)
        return web.Response(
            body=self.body, content_type=self.content_type, charset="utf-8", headers=headers
        )


def add_console_routes(app: web.Application) -> None:
    """Serve the console at ``/iop/console`` on ``app`` (the edge's API application).

    The assets are read from the installed package here, once, so a broken
    install fails when the edge starts rather than on an operator's first visit.
    """
    assets = _load_assets()
    page = assets.pop("console.html")

    async def console(request: web.Request) -> web.Response:
        return page.response(request)

    async def console_slash(request: web.Request) -> web.Response:
        # The page's relative URLs only resolve from /iop/console, not /iop/console/.
        raise web.HTTPPermanentRedirect(CONSOLE_PATH)

    async def static(request: web.Request) -> web.Response:
        asset = assets.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound()
        return asset.response(request)

    app.router.add_get(CONSOLE_PATH, console)
    app.router.add_get(f"{CONSOLE_PATH}/", console_slash)
    app.router.add_get(STATIC_PATH + "/{name}", static)


def _load_assets() -> dict[str, _Asset]:
    assets = {}
    for entry in resources.files("iop_edge.console").joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        content_type = _CONTENT_TYPES.get(suffix)
        if content_type is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[entry.name] = _Asset(body, content_type, etag)
    if "console.html" not in assets:
        raise FileNotFoundError("iop_edge/console/static/console.html is missing from the package")
    return assets


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}
