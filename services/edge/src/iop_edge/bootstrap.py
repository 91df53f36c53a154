"""The edge's composition root: every object is made here and owned by one exit stack."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from iop_edge.settings import EdgeSettings
from iop_proto.service import AdminServer
from iop_proto.tls import server_context


@contextlib.asynccontextmanager
async def build(
    settings: EdgeSettings, registry: CollectorRegistry, admin: AdminServer
) -> AsyncIterator[None]:
    """Start the edge; leaving the context stops it in reverse order."""
    if settings.tls.enabled:
        # Load the certificates now so a broken file fails the start, not the first peer.
        server_context(settings.tls)
    yield
