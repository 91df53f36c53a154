"""Scale: selection among 1,000 providers, 10,000 queued requests, 100 nodes registering.

- selection: the edge's own ``select`` over ``ProviderSlot`` objects (1,000 providers on
  100 nodes, loads varied, one slot taken and one freed between decisions), in
  process, timed per decision; and the same with the candidate list built the way
  ``Dispatcher`` builds it for every request;
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

from iop_edge.domain.pool import AVAILABLE, ProviderSlot, select
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
    """Microseconds per decision of ``select`` among ``providers`` candidates.

    Wall time is what a request waits; CPU time (this thread's) is what the code
    costs, and stays meaningful when other processes share the cores.
    """
    rng = random.Random(seed)
    per_node = max(1, providers // nodes)
    slots: dict[str, ProviderSlot] = {}
    for i in range(providers):
        slot = ProviderSlot(f"p{i}", f"n{i // per_node}", capacity=rng.choice((2, 4, 8)))
        slot.connected, slot.health = True, AVAILABLE
        slot.own_in_flight = rng.randrange(slot.capacity)  # every one has a free slot...
        slots[slot.provider_id] = slot
    order = list(slots)  # ...and the model lists them in fleet order
    candidates = [slots[p] for p in order]
    busy: list[ProviderSlot] = []
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    timings: dict[str, tuple[list[float], list[float]]] = {
        "select": ([], []),
        "decision": ([], []),
    }
    for i in range(decisions):
        kind = "select" if i % 2 else "decision"
        wall_start, cpu_start = wall(), cpu()
        if kind == "select":
            chosen = select(candidates)
        else:  # as Dispatcher._acquire does it: the candidate list, then select
            chosen = select([slots[p] for p in order if p in slots])
        cpu_end, wall_end = cpu(), wall()
        timings[kind][0].append((wall_end - wall_start) / 1000)
        timings[kind][1].append((cpu_end - cpu_start) / 1000)
        # Keep the load steady: take the chosen slot, free one taken before.
        if chosen is not None:
            chosen.take()
            busy.append(chosen)
        if len(busy) > providers // 10:
            busy.pop(rng.randrange(len(busy))).release()
    out: dict[str, Any] = {"providers": providers, "nodes": nodes, "decisions": decisions}
    for kind, (walls, cpus) in timings.items():
        out[f"{kind}_us"] = {
            "p50": percentile(walls, 50),
            "p99": percentile(walls, 99),
            "cpu_p50": percentile(cpus, 50),
            "cpu_p99": percentile(cpus, 99),
        }
    return out


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
        raise RuntimeError(f"{node_id} refused: {response.reason or answer}")
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
                _register_one(core.node_port, node, core.tokens[node], identities[node], providers)
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
    queued = await queue_in_child(settings.queue_waiters)
    registered = await registration(root, settings.registration_nodes, settings.providers_per_node)
    result.data = {"selection": chosen, "queue": queued, "registration": registered}
    expected = settings.registration_nodes * settings.providers_per_node
    if not queued["fifo"] or registered["providers_available"] != expected:
        result.status = "failed"
        result.reason = "queue order not FIFO" if not queued["fifo"] else "providers missing"
    n = settings.providers
    pick, decision = chosen["select_us"], chosen["decision_us"]
    result.rows = [
        Row(SCENARIO, f"select() among {n:,} providers, p50", "us", pick["p50"]),
        Row(SCENARIO, f"select() among {n:,} providers, p99", "us", pick["p99"],
            target="<= 50 us", met=pick["p99"] <= 50),
        Row(SCENARIO, f"select() among {n:,} providers, CPU time p99", "us", pick["cpu_p99"],
            target="<= 50 us", met=pick["cpu_p99"] <= 50),
        Row(SCENARIO, "decision incl. candidate list (as dispatch does), p99", "us",
            decision["p99"]),
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
