"""The dispatcher's cost per run on a pool that reports no load state (vLLM, llama.cpp):
warm-aware scheduling (docs/ARCHITECTURE.md#warm-aware-scheduling) must not add to it.

Eight always-loaded providers of one model in the edge's real ``Dispatcher`` (the fake
node link of ``iop_edge.testing``): rounds of 16 ``open_run`` then their completion.
Prints the microseconds per run (median and best of 7 rounds of 64,000 runs). Compare
two checkouts by the code the interpreter imports, interleaved, on a quiet machine:

    M=<main checkout>; for i in 1 2 3; do
      PYTHONPATH=$M/services/edge/src:$M/proto/src .venv/bin/python tools/bench/warm_select.py
      .venv/bin/python tools/bench/warm_select.py
    done

2026-12-04, 2 busy cores, six runs each: best 23.6 us per run on main (b91c2ee), 23.5 us
with warm-aware scheduling; the medians of each run overlap (24-29 us against 23-32 us).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import RecordingNodeLink, WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb

PROVIDERS, BATCH, BATCHES, ROUNDS = 8, 16, 4000, 7


def provider(number: int) -> ProviderEntry:
    return ProviderEntry(
        id=f"p{number}",
        node_id="n",
        type="vllm",
        category="local_inference",
        models=("m",),
        capacity=8,
        max_queue=64,
        queue_timeout_ms=30_000,
        request_timeout_ms=30_000,
    )


async def measure() -> list[float]:
    providers = [provider(i) for i in range(PROVIDERS)]
    dispatcher = WiredDispatcher(EdgeMetrics.create(CollectorRegistry()))
    model = ModelEntry("m", "m", {p.id: "m" for p in providers})
    dispatcher.pool.apply_fleet(Fleet(1, {"m": model}, {p.id: p for p in providers}))
    states = [pb.ProviderState(provider_id=p.id, health=pb.HEALTH_AVAILABLE) for p in providers]
    dispatcher.pool.node_connected(RecordingNodeLink("n"), provider_reports(states))
    spec = RunSpec("m", Operation.CHAT_COMPLETIONS, {"model": "m"}, False, False)
    rounds = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for _ in range(BATCHES):
            runs = [await dispatcher.open_run(spec) for _ in range(BATCH)]
            for run in runs:
                run.deliver(Completed(finish_reason="stop"))
        rounds.append((time.perf_counter() - started) / (BATCHES * BATCH) * 1e6)
    return rounds


def main() -> None:
    rounds = asyncio.run(measure())
    print(f"us per run: median {statistics.median(rounds):.2f}, best {min(rounds):.2f}")


if __name__ == "__main__":
    main()
