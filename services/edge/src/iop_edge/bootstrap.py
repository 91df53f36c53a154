"""The edge's composition root: every object is made here and owned by one exit stack."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web
from loguru import logger
from prometheus_client import CollectorRegistry

from iop_edge import __version__
from iop_edge.adapters.control_desk import ControlDesk
from iop_edge.adapters.control_plane import ControlPlaneClient
from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.adapters.node_server import NodeServer
from iop_edge.adapters.peer_guard import PeerGuard
from iop_edge.adapters.stores import open_stores
from iop_edge.console import add_console_routes
from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.entrypoints.api_auth import KeySlots, access_mode
from iop_edge.entrypoints.api_metrics import ApiMetrics
from iop_edge.entrypoints.control_routes import ControlRoutes
from iop_edge.entrypoints.http_api import (
    API_FRONT,
    connection_limit_refusal,
    create_api_app,
    load_openapi,
)
from iop_edge.entrypoints.stop_gate import StopGate
from iop_edge.formats.reasoning_seal import ReasoningSeal, parse_key
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import EdgeRunRecord
from iop_edge.service.backfill import Backfill
from iop_edge.service.batches import BatchService
from iop_edge.service.catalog import PoolCatalog
from iop_edge.service.dispatch import Dispatcher
from iop_edge.service.fleet_holder import FleetHolder
from iop_edge.service.key_rates import KeyRates, LineBudget
from iop_edge.service.limits import max_body_bytes
from iop_edge.service.qualifications import QualificationBook
from iop_edge.service.registry import ProviderRegistry
from iop_edge.service.runs import RunGuards
from iop_edge.service.usage import UsageReport
from iop_edge.settings import EdgeSettings
from iop_proto.service import AdminServer
from iop_proto.service.http_site import CappedSite
from iop_proto.tasks import cancel_and_wait
from iop_proto.tls import client_context, server_context
from iop_proto.tracing import open_tracing
from iop_proto.v1 import runtime_pb2 as pb


async def _drain(
    site: CappedSite, gate: StopGate, nodes: NodeServer, dispatcher: Dispatcher, drain_s: float
) -> None:
    """The graceful stop: nothing new comes in, runs in flight finish (up to ``drain_s``),
    and only what is still running then ends with an error.

    The listening sockets close (new connections are refused by the OS), a request on a
    connection kept alive from before gets a 503 (``StopGate``), and the dispatcher takes
    no new run (a batch line stays pending); the node connections stay, they carry the
    runs in flight.
    """
    await site.stop()  # closes the listener only; connections open go on
    nodes.stop_accepting()
    gate.close()
    dispatcher.stop_admitting("edge is stopping")
    try:
        async with asyncio.timeout(drain_s):
            await dispatcher.wait_idle()
        logger.info("drained: every run in flight finished")
    except TimeoutError:
        logger.warning("drain timed out after {:.1f}s: failing the runs left", drain_s)
    await dispatcher.fail_all("edge is stopping")


class Edge:
    """The running edge, for tests and the runner: its parts and bound ports."""

    def __init__(
        self,
        providers: ProviderRegistry,
        dispatcher: Dispatcher,
        nodes: NodeServer,
        control_plane: ControlPlaneClient,
    ) -> None:
        self.providers = providers
        self.dispatcher = dispatcher
        self.nodes = nodes
        self.control_plane = control_plane
        self.http_port = 0


@contextlib.asynccontextmanager
async def build(
    settings: EdgeSettings, registry: CollectorRegistry, admin: AdminServer
) -> AsyncIterator[Edge]:
    """Start the edge; leaving the context stops it in reverse order."""
    server_tls = server_context(settings.tls) if settings.tls.enabled else None
    client_tls = client_context(settings.tls) if settings.tls.enabled else None
    metrics = EdgeMetrics.create(registry)
    # The fleet in force, the live pool with its node links, and the dispatcher
    # that acquires from the pool, starts runs and releases.
    fleet_holder = FleetHolder()
    providers = ProviderRegistry(fleet_holder, metrics, settings.outliers)
    dispatcher = Dispatcher(
        fleet_holder,
        providers,
        metrics,
        settings.max_frame_size,
        deadline_grace_s=settings.deadline_grace_s,
        guards=RunGuards(
            settings.run_ack_timeout_s, settings.stall_timeout_s, settings.first_token_timeout_s
        ),
        affinity=settings.affinity.policy,
        backfill=Backfill(settings.batch.max_share, preempt=settings.batch.preempt),
        warm=settings.warm.policy,
    )
    body_limit = max_body_bytes(settings.max_frame_size)  # what a node link can carry
    catalog = PoolCatalog(fleet_holder, providers, dispatcher)
    keys = fleet_holder  # the key ring: the fleet's API keys (hashes only)
    nodes: NodeServer | None = None
    logged_mode: str | None = None  # what the log said of access last; None: not yet
    http = settings.http

    def log_access_mode() -> None:
        nonlocal logged_mode
        mode = access_mode(keys, http.allow_open, http.host)
        if mode != logged_mode:
            (logger.warning if keys.open else logger.info)(mode)
            logged_mode = mode

    async def on_fleet(config: pb.FleetConfig) -> None:
        fleet = fleet_from_proto(config)
        providers.apply_fleet(fleet)
        if nodes is not None:  # at once: the nodes' new configs go before any run sent now
            await nodes.apply_fleet(config)
        metrics.config_version.set(config.version)
        # A revoked key leaves the fleet: its requests end now, not when they finish,
        # and its batches are cancelled (their lines in flight stopped).
        present = frozenset(k.key_id for k in fleet.api_keys.values())
        await key_slots.apply_keys(present)
        await batches.apply_keys(present)
        if logged_mode is not None:  # the API serves already: say what changed
            log_access_mode()

    async with contextlib.AsyncExitStack() as stack:
        stack.callback(providers.close)  # last out: no cooldown timer outlives the edge
        stack.callback(dispatcher.close)  # nor a warm-aware hold's timer
        stores = await open_stores(settings, stack)
        tracing = open_tracing(settings.tracing, settings.service_id)
        if tracing is not None:  # closed after the drain: the last requests' spans go too
            stack.push_async_callback(tracing.close)
        runlog, response_store, batch_store = stores.runlog, stores.responses, stores.batches
        key_slots = KeySlots(stores.key_slots)  # where keys' slots are counted: the stores say
        storage = settings.storage
        # Keys' rates and budgets, counted where the stores say; batch lines count in
        # their owner's budget (docs/ARCHITECTURE.md#limits-per-key).
        key_rates = KeyRates(stores.key_rates, stores.key_slots)

        def key_of(key_id: str) -> ApiKeyEntry | None:
            return next(
                (k for k in fleet_holder.current.api_keys.values() if k.key_id == key_id), None
            )

        api_metrics = ApiMetrics.create(registry)

        def account_line(record: EdgeRunRecord) -> None:
            """A batch line's run, recorded and counted as an HTTP request's run is."""
            api_metrics.count(record)
            runlog.record(record)

        batches = BatchService(
            batch_store,
            dispatcher,
            catalog,
            registry,
            lease_ttl_s=settings.batch_lease_ttl_s,
            max_body_bytes=body_limit,
            mock_drills=settings.mock_drills,
            file_quota_bytes=storage.files_quota_bytes,
            line_budget=LineBudget(key_rates, key_of),
            account=account_line,
        )
        await batches.refresh_metrics()

        cp = settings.control_plane
        control_plane = ControlPlaneClient(
            host=cp.host,
            port=cp.port,
            server_name=cp.server_name,
            edge_id=settings.service_id,
            version=__version__,
            tls=client_tls,
            cache_file=settings.config_cache,
            on_fleet=on_fleet,
            heartbeat_interval_s=cp.heartbeat_interval_s,
            reconnect_max_s=cp.reconnect_max_s,
            authorize_timeout_s=cp.authorize_timeout_s,
            link_gauge=metrics.control_plane_connected,
            tls_files=settings.tls if settings.tls.enabled else None,
        )
        await control_plane.load_cache()

        nodes = NodeServer(
            host=settings.node_listener.host,
            port=settings.node_listener.port,
            edge_id=settings.service_id,
            registry=providers,
            authorizer=control_plane,
            guard=PeerGuard(dispatcher, providers, metrics, batches),
            metrics=metrics,
            tls=server_tls,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            max_frame_size=settings.max_frame_size,
            batches=batches,
            register_timeout_s=settings.node_listener.register_timeout_s,
            handshake_timeout_s=settings.node_listener.handshake_timeout_s,
        )
        nodes.status.subscribe(control_plane.report_nodes)
        await nodes.start()
        stack.push_async_callback(nodes.aclose)
        if control_plane.config is not None:
            await nodes.apply_fleet(control_plane.config)  # the cached list of edges
        # Dialled once the node listener is bound: the hello says where it is.
        control_plane.node_listener = node_listener_endpoint(settings, nodes.port)
        cp_task = asyncio.create_task(control_plane.run(), name="control-plane")
        stack.push_async_callback(cancel_and_wait, cp_task)

        gate = StopGate()
        app = create_api_app(
            dispatcher,
            catalog,
            keys,
            runlog,
            api_metrics,
            openapi=load_openapi(),
            max_body_bytes=body_limit,
            batches=batches,
            read_timeout_s=settings.http.read_timeout_s,
            key_slots=key_slots,
            key_rates=key_rates,
            allow_open=settings.http.allow_open,
            cors_origins=settings.http.cors_origins,
            min_body_rate=settings.http.min_body_rate,
            stop_gate=gate,
            responses=response_store,
            reasoning_seal=reasoning_seal(settings),
            mock_drills=settings.mock_drills,
            tracing=tracing,
            usage=UsageReport(fleet_holder, runlog, key_slots.held),
            qualifications=QualificationBook(stores.qualifications),
        )
        ControlRoutes(ControlDesk(control_plane), keys).register(app)  # runtime control
        add_console_routes(app)  # the read-only operator page (before setup locks the routes)
        # handler_cancellation: a client that disconnects cancels its handler, which
        # cancels its run at the node (aiohttp leaves it off by default).
        # keepalive_timeout: aiohttp closes a connection that has not sent a whole request's
        # headers this long after it opened or after its previous answer; it is the header
        # read timeout (slowloris) as well as the idle keep-alive limit. Bodies: create_api_app.
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=settings.shutdown_reserve_s / 2,  # after the drain (below)
            keepalive_timeout=settings.http.read_timeout_s,
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        # The inference routes are served by the API's own HTTP/1.1 front, every other
        # request handed to the runner's aiohttp protocol (entrypoints/fast_front.py); its
        # connections close after the drain, before aiohttp's.
        front = app[API_FRONT]
        stack.push_async_callback(front.shutdown, settings.shutdown_reserve_s / 2)
        # At most http.max_connections served at once; more are answered a canned 503, and
        # past that wait in the kernel's backlog: a flood of clients cannot hold the loop
        # (the node links' heartbeats share it) for longer than that many requests take
        # (iop_proto.service.http_site).
        site = CappedSite(
            runner,
            http.host,
            http.port,
            max_connections=http.max_connections,
            backlog=http.backlog,
            refusal=connection_limit_refusal(http.max_connections),
            protocol_factory=front.protocol_factory,
        )
        await site.start()
        # First on the way out: stop accepting, drain, fail what is left (then the rest).
        stack.push_async_callback(_drain, site, gate, nodes, dispatcher, settings.drain_s)
        edge = Edge(providers, dispatcher, nodes, control_plane)
        edge.http_port = site.port
        logger.info("OpenAI API on http://{}:{}/v1", settings.http.host, edge.http_port)
        admin.report_port("http", edge.http_port)
        admin.report_port("nodes", nodes.port)
        log_access_mode()  # from now on logged again whenever keys come or go
        admin.set_readiness(lambda: None if catalog.any_available() else "no provider is available")
        yield edge


def node_listener_endpoint(settings: EdgeSettings, bound_port: int) -> pb.EdgeEndpoint | None:
    """Where this edge's nodes and workers reach it, for the control-plane to list
    (docs/ARCHITECTURE.md#several-edges); ``None``: the edge is not listed."""
    listener = settings.node_listener
    address = listener.advertised(bound_port)
    if address is None:
        logger.info(
            "node_listener.advertise unset and host {} is a wildcard: this edge is not listed"
            " to other edges' nodes and workers",
            listener.host,
        )
        return None
    host, port = address
    return pb.EdgeEndpoint(
        edge_id=settings.service_id,
        host=host,
        port=port,
        server_name=listener.advertise_server_name or "",
    )


def reasoning_seal(settings: EdgeSettings) -> ReasoningSeal:
    """The edges' seal of Responses reasoning: the key file's, or a key of this process."""
    path = settings.reasoning_key_file
    if path is None:
        logger.info(
            "reasoning_key_file unset: reasoning sealed into encrypted_content opens on this"
            " edge only, until it restarts"
        )
        return ReasoningSeal.generate()
    try:
        return ReasoningSeal(parse_key(path.read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"reasoning_key_file ({path}): {exc}") from None
