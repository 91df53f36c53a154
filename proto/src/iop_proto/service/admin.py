"""The admin HTTP port every service serves: ``/healthz``, ``/readyz``, ``/metrics``.

``/readyz`` also names the ports the service listens on (``ports``: e.g. ``http``,
``nodes``), bound ones, so a service configured with port 0 tells where it is.

Metrics live in a registry the service owns (never prometheus' global one), so
two services in one test process never see each other's counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from iop_proto.errors import ConfigurationError
from iop_proto.service.http_site import CappedSite

IDLE_TIMEOUT_S: Final = 15.0
"""An idle admin connection closes after this (``AdminSettings.idle_timeout_s``)."""
MAX_CONNECTIONS: Final = 128
"""Admin connections held at once (``AdminSettings.max_connections``)."""

ReadinessCheck = Callable[[], str | None]
"""Returns ``None`` when ready, else the reason it is not."""


class AdminServer:
    """A tiny aiohttp server; extra routes can be added before ``start()``."""

    def __init__(
        self,
        service: str,
        registry: CollectorRegistry,
        *,
        host: str,
        port: int,
        readiness: ReadinessCheck | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.service = service
        self.registry = registry
        self.host = host
        self.port = port
        self._readiness = readiness
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self.app = web.Application()
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)
        self.app.router.add_get("/metrics", self._metrics)
        self.ports: dict[str, int] = {}  # listener name -> bound port, for /readyz
        self._runner: web.AppRunner | None = None
        self.started = asyncio.Event()  # set once bound: a readiness signal for tests
        self.failure: ConfigurationError | None = None
        self.failed = asyncio.Event()

    def set_readiness(self, check: ReadinessCheck) -> None:
        """Let the service decide ``/readyz`` (e.g. "registered with the edge")."""
        self._readiness = check

    def fail(self, error: ConfigurationError) -> None:
        """The service found, while running, that its configuration cannot work (a
        peer's certificate that does not fit, say): the runner stops it and the process
        exits with code 2. The first failure is the one reported."""
        if self.failure is None:
            self.failure = error
        self.failed.set()

    def fail_on_configuration_error(self, task: asyncio.Task[None]) -> None:
        """``fail`` with the ``ConfigurationError`` that ends ``task``, if one does."""

        def done(finished: asyncio.Task[None]) -> None:
            if finished.cancelled():
                return
            error = finished.exception()
            if isinstance(error, ConfigurationError):
                self.fail(error)

        task.add_done_callback(done)

    def report_port(self, name: str, port: int) -> None:
        """Name a port the service listens on (the bound one, when configured as 0)."""
        self.ports[name] = port

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful when configured as 0).

        Scrapers and probes open connections and may leave them idle: each closes
        ``idle_timeout_s`` after its last answer (aiohttp's default is an hour, and a
        client that opened thousands held as many descriptors), and no more than
        ``max_connections`` are held at once (``CappedSite``).
        """
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self._idle_timeout_s,
        )
        await self._runner.setup()
        site = CappedSite(self._runner, self.host, self.port, max_connections=self._max_connections)
        await site.start()
        self.port = site.port
        self.started.set()
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": self.service})

    async def _readyz(self, request: web.Request) -> web.Response:
        reason = self._readiness() if self._readiness else None
        if reason is not None:
            return web.json_response(
                {"status": "not_ready", "reason": reason, "ports": self.ports}, status=503
            )
        return web.json_response({"status": "ready", "service": self.service, "ports": self.ports})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
