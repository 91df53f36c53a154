"""Issue 31, limits and affinity across edges: the figures of the checkout the venv imports
(``PYTHONPATH`` of another checkout's ``src`` folders measures that one): the same
script before and after.

1. **Affinity**: two dispatchers ("edges") over the same fleet of three providers
   (capacity 4 each), edge A carrying one run the other does not see; ``--sessions``
   new sessions each open a first turn on both: how many start on the same provider on
   both, and how the sessions spread.
2. **Cost without postgres**: microseconds per request for a key with a limit to take
   and give back its slot (``KeySlots.hold``), the inference path's part of this work.

(The limit itself across two real edges: ``tests/e2e/test_key_limit_across_edges.py``,
run with ``-s``, prints it; under sustained load and through an edge's SIGKILL:
``limits_sustained.py``.)

    .venv/bin/python tools/hardening/limits_across_edges.py [--sessions 300]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed
from iop_edge.domain.fleet import ApiKeyEntry, Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.entrypoints.api_auth import KeySlots
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import RecordingNodeLink, WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb

PIDS = ("a", "b", "c")


def an_edge() -> WiredDispatcher:
    providers = {
        pid: ProviderEntry(
            id=pid,
            node_id=f"n-{pid}",
            type="mock",
            category="local_inference",
            models=("m",),
            capacity=4,
            max_queue=8,
            queue_timeout_ms=2_000,
            request_timeout_ms=30_000,
        )
        for pid in PIDS
    }
    dispatcher = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()))
    model = ModelEntry("m", "m", {pid: "served" for pid in PIDS})
    dispatcher.pool.apply_fleet(Fleet(version=1, models={"m": model}, providers=providers))
    for pid in PIDS:
        state = pb.ProviderState(provider_id=pid, health=pb.HEALTH_AVAILABLE)
        dispatcher.pool.node_connected(RecordingNodeLink(f"n-{pid}"), provider_reports([state]))
    return dispatcher


async def affinity(sessions: int) -> None:
    edge_a, edge_b = an_edge(), an_edge()
    await edge_a.open_run(RunSpec("m", Operation.CHAT_COMPLETIONS, {"model": "m"}, True, True))
    same, spread = 0, Counter[str]()
    for n in range(sessions):
        session = f"key\x00session-{n}"
        body = {"model": "m", "messages": [{"role": "user", "content": f"hi {n}"}]}
        spec = RunSpec("m", Operation.CHAT_COMPLETIONS, body, True, True, session=session)
        chosen = []
        for edge in (edge_a, edge_b):
            run = await edge.open_run(spec)
            chosen.append(run.provider_id)
            run.deliver(Completed(finish_reason="stop"))
        same += chosen[0] == chosen[1]
        spread[chosen[1]] += 1
    print(
        f"affinity: {same}/{sessions} new sessions start on the same provider on both edges;"
        f" edge B's spread {dict(sorted(spread.items()))}"
    )


async def cost(rounds: int) -> None:
    slots = KeySlots()
    key = ApiKeyEntry("k", "k", "hash", frozenset(), 4)
    run: Any = object()
    # main's hold is a plain context manager, this branch's an async one
    is_async = hasattr(slots.hold(key, run), "__aenter__")
    started = time.perf_counter()
    for _ in range(rounds):
        if is_async:
            async with slots.hold(key, run):
                pass
        else:
            with slots.hold(key, run):
                pass
    per_us = (time.perf_counter() - started) / rounds * 1e6
    print(f"cost without postgres: {per_us:.2f} us per request of a limited key (hold + release)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=200_000)
    args = parser.parse_args()
    asyncio.run(affinity(args.sessions))
    asyncio.run(cost(args.rounds))


if __name__ == "__main__":
    main()
