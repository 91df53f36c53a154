"""Stored responses and run records shared by two edges on one PostgreSQL, for checkouts.

    tools/hardening/shared_responses.py CHECKOUT [CHECKOUT ...] [--turns 200] [--runs 1000]

For each checkout (its sources on ``PYTHONPATH``, as ``tools/bench/ab.py`` runs
them): a throwaway PostgreSQL cluster (Debian's server, ``iop_proto.testing_postgres``)
and two edges' stores opened as the edge opens them (``adapters.stores.open_stores``,
a ``postgres`` section set, SQLite files of their own). Edge A keeps ``--turns``
turns (conversations of ten) and records ``--runs`` runs; the figures say how many
edge B reads (by the same key, and by another), how long a ``keep`` takes on A, then
what happens to ``--runs`` more runs recorded on A while the server is stopped and
started again: how long a ``record`` call takes, and how many B lists once it is back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SOURCES = (
    "proto/src",
    *(f"services/{name}/src" for name in ("edge", "node", "control-plane", "worker")),
)


async def measure(turns: int, runs: int) -> dict[str, Any]:
    from iop_edge.adapters.stores import open_stores
    from iop_edge.ports import EdgeRunRecord, StoredResponse
    from iop_edge.settings import EdgeSettings
    from iop_proto.testing_postgres import running_postgres

    def edge(root: Path, name: str, dsn: str) -> Any:
        tls = {"ca_file": "ca.pem", "cert_file": "e.pem", "key_file": "e.key"}
        return EdgeSettings(
            service_id=name,
            tls=tls,
            postgres={"dsn": dsn, "connect_timeout_s": 2},
            history_db=root / name / "runs.db",
            responses_db=root / name / "responses.db",
            batch_db=root / name / "batches.db",
        )

    def run(n: int) -> EdgeRunRecord:
        return EdgeRunRecord(
            f"run-{n:06}", "m", "p", "node", "responses", False, "completed", 200, "",
            1_800_000_000_000 + n, 1, 2, 3, 4, 5, "key_a",
        )  # fmt: skip

    figures: dict[str, Any] = {}
    with running_postgres() as server, tempfile.TemporaryDirectory() as tmp:
        dsn = server.create_database()
        async with contextlib.AsyncExitStack() as stack:
            a = await open_stores(edge(Path(tmp), "edge-a", dsn), stack)
            b = await open_stores(edge(Path(tmp), "edge-b", dsn), stack)
            kept: list[StoredResponse] = []
            took: list[float] = []
            for n in range(turns):
                previous = kept[-1] if n % 10 else None
                turn = StoredResponse(
                    f"resp_{n:06}", "key_a", int(time.time()), b'{"output":[]}' * 20,
                    b'[{"id":"in"}]' * 20, previous and previous.response_id,
                    0 if previous is None else previous.depth + 1,
                )  # fmt: skip
                started = time.perf_counter()
                await a.responses.keep(turn)
                took.append((time.perf_counter() - started) * 1000)
                kept.append(turn)
            found = [await b.responses.get(t.response_id, "key_a") for t in kept]
            chains = [await b.responses.chain(t.response_id, "key_a") for t in kept]
            foreign = [await b.responses.get(t.response_id, "key_b") for t in kept]
            figures["turns kept on A"] = turns
            figures["found on B (get)"] = sum(f == t for f, t in zip(found, kept, strict=True))
            figures["found on B (chain, whole)"] = sum(
                c is not None and len(c) == t.depth + 1 for c, t in zip(chains, kept, strict=True)
            )
            figures["found on B by another key"] = sum(f is not None for f in foreign)
            figures["keep on A p50 ms"] = round(statistics.median(took), 2)
            figures["keep on A p99 ms"] = round(sorted(took)[int(len(took) * 0.99) - 1], 2)

            for n in range(runs):
                a.runlog.record(run(n))
            await a.runlog.flush()  # type: ignore[attr-defined]
            listed = await b.runlog.recent(2 * runs + 10)
            figures["runs recorded on A"] = runs
            figures["runs listed on B"] = len(listed)

            await asyncio.to_thread(server.down)
            calls: list[float] = []
            for n in range(runs, 2 * runs):
                started = time.perf_counter()
                a.runlog.record(run(n))
                calls.append(time.perf_counter() - started)
            refused = 0
            try:
                await a.responses.get(kept[0].response_id, "key_a")
            except Exception as exc:
                refused = int(type(exc).__name__ == "StorageUnavailable")
            await asyncio.to_thread(server.up)
            await asyncio.wait_for(a.runlog.flush(), 120)  # type: ignore[attr-defined]
            listed = await b.runlog.recent(2 * runs + 10)
            figures["runs recorded on A while down"] = runs
            figures["record() while down p50 us"] = round(statistics.median(calls) * 1e6, 1)
            # the longest call is the machine's (a GC pass, a preemption), not a wait
            figures["record() while down max us"] = round(max(calls) * 1e6, 1)
            figures["store call while down: StorageUnavailable"] = refused
            figures["of those, listed on B after"] = sum(
                r.run_id >= f"run-{runs:06}" for r in listed
            )
            figures["after: dropped on A"] = getattr(a.runlog, "dropped", 0)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", nargs="*", type=Path)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.inner:
        print(json.dumps(asyncio.run(measure(options.turns, options.runs))))
        return
    for checkout in options.checkouts:
        path = os.pathsep.join(str(checkout.resolve() / s) for s in SOURCES)
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--inner",
                f"--turns={options.turns}",
                f"--runs={options.runs}",
            ],
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"== {checkout}")
        for name, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
            print(f"  {name:45} {value}")


if __name__ == "__main__":
    main()
