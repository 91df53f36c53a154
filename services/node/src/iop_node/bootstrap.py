"""The node's composition root: adapters are registered here, explicitly, one line each."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Mapping

import aiohttp
from prometheus_client import CollectorRegistry

from iop_node import __version__
from iop_node.adapters import cli, lemonade, llamaswap, mock, ollama, openai_compat
from iop_node.adapters.provider_http import ProviderHttp
from iop_node.adapters.sqlite_history import SqliteRunHistory
from iop_node.entrypoints.edge_link import EdgeLink, Neighbours, drain
from iop_node.metrics import NodeMetrics
from iop_node.ports import AdapterContext, AdapterFactory
from iop_node.service.providers import NodeCore, ProbeSettings
from iop_node.settings import NodeSettings
from iop_proto.dialer import DialSettings, LinkGauge
from iop_proto.edges import EdgeLinks
from iop_proto.framing import max_answer_bytes
from iop_proto.service import AdminServer
from iop_proto.tasks import cancel_and_wait
from iop_proto.tls import client_context
from iop_proto.tracing import open_tracing

ADAPTERS: Mapping[str, AdapterFactory] = {
    "mock": mock.MockAdapter,
    "cli": cli.CliAdapter,
    "ollama": ollama.OllamaAdapter,
    "vllm": openai_compat.factory("vllm"),
    "sglang": openai_compat.factory("sglang"),
    "lemonade": lemonade.LemonadeAdapter,
    "llamacpp": openai_compat.factory("llamacpp"),
    "llamaswap": llamaswap.LlamaSwapAdapter,
    "openai_api": openai_compat.factory("openai_api"),
}


@contextlib.asynccontextmanager
async def build(
    settings: NodeSettings, registry: CollectorRegistry, admin: AdminServer
) -> AsyncIterator[NodeCore]:
    """Start the node; leaving the context stops it in reverse order."""
    tls = client_context(settings.tls) if settings.tls.enabled else None
    token = settings.read_token()
    metrics = NodeMetrics.create(registry)
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        )
        engines = ProviderHttp()
        stack.push_async_callback(engines.aclose)
        history = await SqliteRunHistory.open(settings.history_db)
        stack.push_async_callback(history.aclose)
        tracing = open_tracing(settings.tracing, settings.service_id)
        if tracing is not None:  # closed after the runs: their last spans go too
            stack.push_async_callback(tracing.close)

        core = NodeCore(
            settings.service_id,
            ADAPTERS,
            AdapterContext(
                http=http,
                environ=dict(os.environ),
                max_answer_bytes=max_answer_bytes(settings.max_frame_size),
                engines=engines,
            ),
            history,
            metrics,
            ProbeSettings(**settings.probes.model_dump()),
            settings.cache_prefixes,
            tracing=tracing,
        )
        stack.push_async_callback(core.aclose)

        draining = False
        neighbours = Neighbours()

        def make_link(dial: DialSettings, gauge: LinkGauge) -> EdgeLink:
            link = EdgeLink(dial, settings, core, tls, token, gauge, __version__, neighbours)
            if draining:
                link.begin_drain()  # an edge listed while the node stops hears it at once
            return link

        seeds = [
            DialSettings.of(settings, settings.register_timeout_s, settings.max_frame_size, edge)
            for edge in settings.seeds
        ]
        links = EdgeLinks(seeds, make_link, metrics.edge_connected, follow=settings.follow_edges)
        links_task = asyncio.create_task(links.run(), name="edge-links")
        admin.fail_on_configuration_error(links_task)  # e.g. the edge's certificate does not fit
        stack.push_async_callback(cancel_and_wait, links_task)

        async def drain_links() -> None:
            # First on the way out: runs in flight finish; shutdown_reserve_s is kept for
            # closing the links, the adapters and the history.
            nonlocal draining
            draining = True
            await drain(links.links, core, settings.drain_s)

        stack.push_async_callback(drain_links)

        admin.set_readiness(lambda: None if links.registered.is_set() else "not registered")
        yield core
