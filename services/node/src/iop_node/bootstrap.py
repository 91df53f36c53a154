"""The node's composition root: adapters are registered here, explicitly, one line each."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Mapping

import aiohttp
from prometheus_client import CollectorRegistry

from iop_node import __version__
from iop_node.adapters import cli, mock, ollama, openai_compat
from iop_node.adapters.provider_http import ProviderHttp
from iop_node.adapters.sqlite_history import SqliteRunHistory
from iop_node.entrypoints.edge_link import EdgeLink
from iop_node.metrics import NodeMetrics
from iop_node.ports import AdapterContext, AdapterFactory
from iop_node.service.providers import NodeCore, ProbeSettings
from iop_node.settings import NodeSettings
from iop_proto.framing import max_answer_bytes
from iop_proto.service import AdminServer
from iop_proto.tasks import cancel_and_wait
from iop_proto.tls import client_context

ADAPTERS: Mapping[str, AdapterFactory] = {
    "mock": mock.MockAdapter,
    "cli": cli.CliAdapter,
    "ollama": ollama.OllamaAdapter,
    "vllm": openai_compat.factory("vllm"),
    "sglang": openai_compat.factory("sglang"),
    "lemonade": openai_compat.factory("lemonade"),
    "llamacpp": openai_compat.factory("llamacpp"),
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
        )
        stack.push_async_callback(core.aclose)

        link = EdgeLink(settings, core, tls, token, metrics, __version__)
        link_task = asyncio.create_task(link.run(), name="edge-link")
        admin.fail_on_configuration_error(link_task)  # e.g. the edge's certificate does not fit
        stack.push_async_callback(cancel_and_wait, link_task)
        # First on the way out: runs in flight finish; shutdown_reserve_s is kept for closing
        # the link, the adapters and the history.
        stack.push_async_callback(link.drain, settings.drain_s)

        admin.set_readiness(lambda: None if link.registered.is_set() else "not registered")
        yield core
