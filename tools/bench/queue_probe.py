"""N requests queued on one model in the edge's real ``Dispatcher``: memory and order.

A script of its own (``python tools/bench/queue_probe.py 10000`` prints JSON), run in a
fresh interpreter by the scale scenario so that the RSS it reports belongs to the
queue and the edge code, not to the benchmark client. It imports only what the
edge's dispatch imports.

One provider with one slot is kept busy; N requests call ``open_run`` and wait in
the model's FIFO. Then the running request completes, the head of the queue gets
the slot and is sent to the (fake) node link, and so on: the order in which runs
reach the link must be the order the requests arrived in.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from iop_edge.adapters.run_wire import provider_reports
from iop_edge.domain.events import Completed, RunOrder
from iop_edge.domain.fleet import Fleet, ModelEntry, Operation, ProviderEntry
from iop_edge.metrics import EdgeMetrics
from iop_edge.ports import RunSpec
from iop_edge.testing import WiredDispatcher
from iop_proto.v1 import runtime_pb2 as pb

MODEL = "m"


def _rss_mib() -> float:
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


class FakeLink:
    """A node link that records the runs sent to it, in order."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.acknowledges_runs = False
        self.sent: asyncio.Queue[pb.RunRequest] = asyncio.Queue()

    async def send_run(self, request: RunOrder) -> None:
        self.sent.put_nowait(request)

    async def send_cancel(self, run_id: str, reason: str) -> None:
        """Nothing is cancelled in this benchmark."""


def _spec(seq: int) -> RunSpec:
    # ``metadata``: a field every provider type is sent (the edge drops the others)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"seq": seq},
    }
    return RunSpec(MODEL, Operation.CHAT_COMPLETIONS, body, stream=False, include_usage=False)


async def probe(waiters: int) -> dict[str, Any]:
    """Queue ``waiters`` requests behind one busy slot, then serve them one by one."""
    metrics = EdgeMetrics.create(CollectorRegistry())
    dispatcher = WiredDispatcher(metrics)  # bootstrap's wiring, its settings' defaults
    pool = dispatcher.pool
    provider = ProviderEntry(
        id="p",
        node_id="n",
        type="openai_api",
        category="api",
        models=(MODEL,),
        capacity=1,
        max_queue=waiters + 1,
        queue_timeout_ms=600_000,
        request_timeout_ms=600_000,
    )
    model = ModelEntry(MODEL, MODEL, {"p": MODEL})
    pool.apply_fleet(Fleet(version=1, models={MODEL: model}, providers={"p": provider}))
    link = FakeLink("n")
    state = pb.ProviderState(provider_id="p", health=pb.HEALTH_AVAILABLE, capacity=1)
    pool.node_connected(link, provider_reports([state]))

    current = (await dispatcher.open_run(_spec(0))).run_id
    await link.sent.get()
    gc.collect()
    before = _rss_mib()
    started = time.perf_counter()
    tasks = [asyncio.create_task(dispatcher.open_run(_spec(i))) for i in range(1, waiters + 1)]
    # Each task runs to its ``await`` on the queue within one turn of the loop.
    for _ in range(100):
        if dispatcher.queued(MODEL) >= waiters:
            break
        await asyncio.sleep(0)
    else:
        raise RuntimeError(f"only {dispatcher.queued(MODEL)} of {waiters} requests queued")
    enqueue_s = time.perf_counter() - started
    gc.collect()
    held = _rss_mib()

    served: list[int] = []
    started = time.perf_counter()
    async with asyncio.timeout(120):
        for _ in range(waiters):
            dispatcher.runs[current].deliver(Completed())
            request = await link.sent.get()
            served.append(json.loads(request.body_json)["metadata"]["seq"])
            current = request.run_id
        await asyncio.gather(*tasks)
    drain_s = time.perf_counter() - started
    return {
        "waiters": waiters,
        "rss_before_mib": before,
        "rss_with_queue_mib": held,
        "rss_added_mib": held - before,
        "fifo": served == list(range(1, waiters + 1)),
        "enqueue_s": enqueue_s,
        "served_per_s": waiters / drain_s if drain_s else float("nan"),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe(int(sys.argv[1])))))
