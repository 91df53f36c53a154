"""Scale: selection among 1,000 providers, 10,000 queued requests, 100 nodes registering.

- selection: the edge's own per-model index (``ModelIndex`` over ``ProviderSlot``
  objects, built by ``index_models`` as ``ProviderRegistry.apply_fleet`` builds it; 1,000
  providers on 100 nodes, loads varied), in process, timed per decision with the
  index upkeep it causes: ``select``, ``take`` of the chosen slot and ``release`` of
  one taken before, the calls ``Dispatcher`` makes; and a whole ``open_run`` through
  the edge's ``Dispatcher`` (fake node links) over the same pool;
- queue: the edge's ``Dispatcher`` with a fake node link, one model with one busy
  slot and 10,000 requests waiting for it; the RSS of the process holding them, and
  the order they are served in (FIFO is checked request by request). Run in a
  child process (``queue_probe.py``) so the RSS is the queue's, not the client's;
- registration: a real control-plane and edge, 100 nodes with 10 providers each
  dialling in at once over mTLS (in-process node clients speaking the real
  protocol: a hundred node processes would not fit in 2 cores); the time until all
  are registered, and the edge's catalog checked to list every provider.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.domain.pool import AVAILABLE, ProviderSlot, index_models
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import WiredDispatcher
from iop_proto.connection import Connection
from iop_proto.tls import TlsSettings, client_context
from iop_proto.v1 import runtime_pb2 as pb

from .client import percentile
from .results import Row, ScenarioResult
from .stack import ProviderSpec, fleet_for, start_core

SCENARIO = "scale"
SCALE_MODEL = "bench-scale"
QUEUE_PROBE: Final = Path(__file__).resolve().parent / "queue_probe.py"


@dataclass(frozen=True)
class Settings:
    providers: int
    nodes: int
    decisions: int
    queue_waiters: int
    registration_nodes: int
    providers_per_node: int = 10


# ---------------------------------------------------------------- selection


def selection(providers: int, nodes: int, decisions: int, seed: int = 7) -> dict[str, Any]:
    """Microseconds per decision among ``providers`` providers serving one model.

    A decision is what each request costs the index: ``select``, ``take`` of the
    chosen slot (the index re-files it), and one ``release`` of a slot taken
    before (a run ending: re-filed again); about a tenth of the pool stays taken
    by this benchmark on top of the loads it starts with. Wall time is what a
    request waits; CPU time (this thread's) is what the code costs, and stays
    meaningful when other processes share the cores.
    """
    rng = random.Random(seed)
    per_node = max(1, providers // nodes)
    slots: list[ProviderSlot] = []
    for i in range(providers):
        slot = ProviderSlot(f"p{i}", f"n{i // per_node}")
        slot.update(capacity=rng.choice((2, 4, 8)), connected=True, health=AVAILABLE)
        for _ in range(rng.randrange(slot.capacity)):  # every one has a free slot
            slot.take()
        slots.append(slot)
    # the model lists them in fleet order, as ProviderRegistry.apply_fleet indexes them
    index = index_models([(SCALE_MODEL, slots)], slots)[SCALE_MODEL]
    busy: list[ProviderSlot] = []
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(decisions):
        freed = busy.pop(rng.randrange(len(busy))) if len(busy) > providers // 10 else None
        wall_start, cpu_start = wall(), cpu()
        chosen = index.select()
        if chosen is not None:
            chosen.take()
        if freed is not None:
            freed.release()
        cpu_end, wall_end = cpu(), wall()
        walls.append((wall_end - wall_start) / 1000)
        cpus.append((cpu_end - cpu_start) / 1000)
        if chosen is not None:
            busy.append(chosen)
    return {
        "providers": providers,
        "nodes": nodes,
        "decisions": decisions,
        "decision_us": {
            "p50": percentile(walls, 50),
            "p99": percentile(walls, 99),
            "cpu_p50": percentile(cpus, 50),
            "cpu_p99": percentile(cpus, 99),
        },
    }


class _FakeLink:
    """A node link that accepts runs and drops them (the benchmark ends them itself)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False

    async def send_run(self, request: RunOrder) -> None:
        """Sent."""

    async def send_cancel(self, run_id: str, reason: str) -> None:
        """Nothing is cancelled in this benchmark."""


async def dispatch_path(providers: int, nodes: int, requests: int, seed: int = 7) -> dict[str, Any]:
    """Microseconds per ``Dispatcher.open_run`` over the same kind of pool: selection,
    metrics, the run request built, the run sent to a fake node link."""
    rng = random.Random(seed)
    per_node = max(1, providers // nodes)
    entries = {
        f"p{i}": ProviderEntry(
            id=f"p{i}",
            node_id=f"n{i // per_node}",
            type="mock",
            category="local_inference",
            models=(SCALE_MODEL,),
            capacity=rng.choice((2, 4, 8)),
            max_queue=1,
            queue_timeout_ms=1_000,
            request_timeout_ms=600_000,
        )
        for i in range(providers)
    }
    model = ModelEntry(SCALE_MODEL, SCALE_MODEL, {p: SCALE_MODEL for p in entries})
    metrics = EdgeMetrics.create(CollectorRegistry())
    dispatcher = WiredDispatcher(metrics)  # bootstrap's wiring, its settings' defaults
    pool = dispatcher.pool
    pool.apply_fleet(Fleet(version=1, models={SCALE_MODEL: model}, providers=entries))
    for n in sorted({e.node_id for e in entries.values()}):
        states = [
            pb.ProviderState(
                provider_id=e.id,
                health=pb.HEALTH_AVAILABLE,
                capacity=e.capacity,
                in_flight=rng.randrange(e.capacity),
            )
            for e in entries.values()
            if e.node_id == n
        ]
        pool.node_connected(_FakeLink(n), provider_reports(states))
    spec = RunSpec(
        SCALE_MODEL,
        Operation.CHAT_COMPLETIONS,
        {"model": SCALE_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        stream=False,
        include_usage=False,
    )
    done = Completed(finish_reason="stop")
    runs = []
    walls: list[float] = []
    wall = time.perf_counter_ns
    for _ in range(requests):
        wall_start = wall()
        run = await dispatcher.open_run(spec)  # the request's run, on its provider
        walls.append((wall() - wall_start) / 1000)
        runs.append(run)
        if len(runs) > providers // 10:
            ended = runs.pop(rng.randrange(len(runs)))
            ended.deliver(done)
    for run in runs:
        run.deliver(done)
    return {"requests": requests, "p50": percentile(walls, 50), "p99": percentile(walls, 99)}


async def queue_in_child(waiters: int) -> dict[str, Any]:
    """``queue_probe.py`` in a fresh interpreter: the RSS it reports is the queue's alone."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(QUEUE_PROBE),
        str(waiters),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 180)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"queue probe failed ({process.returncode}): {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


# ---------------------------------------------------------------- registration

REGISTER_ATTEMPTS = 3
REGISTER_RETRY_S = 0.5  # iop-node's dialer backs off from 0.5 s too


class Refused(RuntimeError):
    """The edge refused a registration (its log says why)."""


async def _register_until_accepted(
    port: int, node_id: str, token: str, tls: TlsSettings, providers: Sequence[ProviderSpec]
) -> tuple[float, Connection, int]:
    """A node's registration retried after a refusal, as iop-node's dialer does (a loaded
    machine can keep the control-plane's verdict past the edge's wait); returns (seconds
    from the first attempt, open connection, refusals before it)."""
    started = time.perf_counter()
    for refusals in range(REGISTER_ATTEMPTS):
        try:
            _, conn = await _register_one(port, node_id, token, tls, providers)
        except Refused:
            if refusals == REGISTER_ATTEMPTS - 1:
                raise
            await asyncio.sleep(REGISTER_RETRY_S)
        else:
            return time.perf_counter() - started, conn, refusals
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _register_one(
    port: int, node_id: str, token: str, tls: TlsSettings, providers: Sequence[ProviderSpec]
) -> tuple[float, Connection]:
    """One node's registration, as iop-node does it; returns (seconds, open connection)."""
    context = client_context(tls)
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    conn = Connection(reader, writer, sender_id=node_id)
    states = [
        pb.ProviderState(
            provider_id=p.id,
            type=p.type,
            health=pb.HEALTH_AVAILABLE,
            capacity=p.capacity,
            models=list(p.models),
        )
        for p in providers
    ]
    request = pb.RegisterRequest(
        peer_id=node_id, token=token, version="bench", role=pb.PEER_ROLE_NODE, providers=states
    )
    sent = await conn.send(request)
    answer = await conn.receive()
    elapsed = time.perf_counter() - started
    response = answer.register_response
    if answer.correlation_id != sent.message_id or not response.accepted:
        await conn.close()
        raise Refused(f"{node_id} refused: {response.reason or answer}")
    return elapsed, conn


async def registration(root: Path, nodes: int, providers_per_node: int) -> dict[str, Any]:
    """``nodes`` nodes register at once with a real edge; seconds until all are in."""
    fleet_nodes = {
        f"node-{n:03d}": [
            ProviderSpec(
                f"node-{n:03d}-p{j}",
                "mock",
                "local_inference",
                models=(SCALE_MODEL,),
                capacity=4,
            )
            for j in range(providers_per_node)
        ]
        for n in range(nodes)
    }
    async with start_core(root, fleet_for(fleet_nodes), list(fleet_nodes)) as core:
        identities = {node: core.identity(node, "node") for node in fleet_nodes}
        started = time.perf_counter()
        outcomes = await asyncio.gather(
            *(
                _register_until_accepted(
                    core.node_port, node, core.tokens[node], identities[node], providers
                )
                for node, providers in fleet_nodes.items()
            ),
            return_exceptions=True,
        )
        total_s = time.perf_counter() - started
        conns = [o[1] for o in outcomes if isinstance(o, tuple)]
        try:
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            if failures:
                raise RuntimeError(f"{len(failures)} registrations failed: {failures[0]!r}")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{core.edge_url}/iop/v1/catalog/models") as response:
                    rows = (await response.json())["data"]
            available = next(len(r["available_providers"]) for r in rows if r["id"] == SCALE_MODEL)
        finally:
            for conn in conns:
                with contextlib.suppress(Exception):
                    await conn.close()
    each = [o[0] * 1000 for o in outcomes if isinstance(o, tuple)]
    return {
        "refused_then_retried": sum(o[2] for o in outcomes if isinstance(o, tuple)),
        "nodes": nodes,
        "providers": nodes * providers_per_node,
        "total_s": total_s,
        "per_node_ms": {"p50": percentile(each, 50), "p99": percentile(each, 99)},
        "providers_available": available,
    }


# ---------------------------------------------------------------- the scenario


async def run(root: Path, settings: Settings) -> ScenarioResult:
    result = ScenarioResult(SCENARIO)
    chosen = selection(settings.providers, settings.nodes, settings.decisions)
    chosen["open_run_us"] = await dispatch_path(
        settings.providers, settings.nodes, max(1, settings.decisions // 4)
    )
    queued = await queue_in_child(settings.queue_waiters)
    registered = await registration(root, settings.registration_nodes, settings.providers_per_node)
    result.data = {"selection": chosen, "queue": queued, "registration": registered}
    expected = settings.registration_nodes * settings.providers_per_node
    if not queued["fifo"] or registered["providers_available"] != expected:
        result.status = "failed"
        result.reason = "queue order not FIFO" if not queued["fifo"] else "providers missing"
    n = settings.providers
    pick, opened = chosen["decision_us"], chosen["open_run_us"]
    result.rows = [
        Row(SCENARIO, f"selection among {n:,} providers (select+take+release), p50", "us",
            pick["p50"]),
        Row(SCENARIO, f"selection among {n:,} providers (select+take+release), p99", "us",
            pick["p99"], target="<= 50 us", met=pick["p99"] <= 50),
        Row(SCENARIO, f"selection among {n:,} providers, CPU time p99", "us", pick["cpu_p99"],
            target="<= 50 us", met=pick["cpu_p99"] <= 50),
        Row(SCENARIO, f"Dispatcher.open_run among {n:,} providers (fake node link), p99", "us",
            opened["p99"]),
        Row(SCENARIO, f"RSS with {settings.queue_waiters:,} queued requests (whole process)",
            "MiB", queued["rss_with_queue_mib"], target="< 200 MB",
            met=queued["rss_with_queue_mib"] * 1.048576 < 200),
        Row(SCENARIO, f"RSS added by {settings.queue_waiters:,} queued requests", "MiB",
            queued["rss_added_mib"]),
        Row(SCENARIO, "queue served in FIFO order", "", None, target="FIFO",
            met=bool(queued["fifo"])),
        Row(SCENARIO, "queue drained, one slot freed at a time", "dispatches/s",
            queued["served_per_s"]),
        Row(SCENARIO, f"registration of {settings.registration_nodes} nodes at once, all in",
            "s", registered["total_s"]),
        Row(SCENARIO, "registration per node, p99", "ms", registered["per_node_ms"]["p99"]),
    ]  # fmt: skip
    return result
