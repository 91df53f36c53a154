"""Two edges on one PostgreSQL: do they share files, batches and leases, and how?

    PYTHONPATH=CHECKOUT/proto/src:CHECKOUT/services/edge/src \\
        .venv/bin/python tools/hardening/batches_two_edges.py [--batches 10] [--mib 64]

Runs against any checkout (its sources first on ``PYTHONPATH``). A throwaway
PostgreSQL server (Debian's, ``iop_proto.testing_postgres``) and two edges' stores
opened by ``open_stores`` with the same ``postgres`` section and their own SQLite
paths, each under a ``BatchService`` with no model (every line fails at once, 404,
without a fleet). Edge A makes the batches; both edges lease at once, round after
round, then run every line of every lease through both edges at once. Printed:
what B sees of A's batches, the grants (a batch granted twice is a broken lease),
the lines stored (each should be stored once), and a ``--mib`` upload through A read
back through B (peak traced memory, MiB/s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from iop_edge.adapters.stores import open_stores
from iop_edge.service.batches import BatchService
from iop_edge.settings import EdgeSettings
from iop_proto.testing_postgres import running_postgres

MIB = 1024 * 1024
CHAT = "/v1/chat/completions"


class Nothing:
    """The run and catalog ports: no model exists, nothing runs."""

    def model(self, model_id: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"unexpected call: {name}")


def edge_settings(root: Path, name: str, dsn: str) -> EdgeSettings:
    return EdgeSettings.model_validate(
        {
            "service_id": f"edge-{name}",
            "tls": {"enabled": False},
            "postgres": {"dsn": dsn},
            "batch_db": str(root / name / "batches.db"),
            "history_db": str(root / name / "runs.db"),
            "responses_db": str(root / name / "responses.db"),
        }
    )


def jsonl(count: int) -> bytes:
    line = '{"custom_id": "r%d", "method": "POST", "url": "%s", "body": {"model": "absent"}}\n'
    return b"".join((line % (n, CHAT)).encode() for n in range(count))


async def measure(batches: int, mib: int) -> None:
    with running_postgres() as server, tempfile.TemporaryDirectory() as tmp:
        dsn = server.create_database()
        async with contextlib.AsyncExitStack() as stack:
            services, registries = [], []
            for name in "ab":
                stores = await open_stores(edge_settings(Path(tmp), name, dsn), stack)
                registries.append(CollectorRegistry())
                services.append(
                    BatchService(stores.batches, Nothing(), Nothing(), registries[-1])  # type: ignore[arg-type]
                )
            a, b = services
            made = []
            for _ in range(batches):
                async with a.receive_file() as upload:
                    await upload.write(jsonl(3))
                    file = await a.create_file(upload, "in.jsonl", "batch")
                made.append((await a.create_batch(file["id"], CHAT, "24h", None))["id"])
            seen = len((await b.list_batches(None, 100))["data"])
            print(f"batches made on A: {batches}; seen from B: {seen}")

            grants = []
            for _ in range(batches):
                grants.extend(await asyncio.gather(a.lease("wa"), b.lease("wb")))
            granted = Counter(g.batch_id for g in grants if g.batch_id)
            twice = sum(1 for count in granted.values() if count > 1)
            print(
                f"lease rounds: {batches} x 2 edges at once; grants: {sum(granted.values())}; "
                f"batches granted: {len(granted)}; granted more than once: {twice}"
            )

            runs = [
                edge.run_line(g.lease_id, n)
                for g in grants
                if g.batch_id
                for n in range(g.total_lines)
                for edge in (a, b)
            ]
            replies = await asyncio.gather(*runs, return_exceptions=True)
            errors = sum(isinstance(r, BaseException) for r in replies)
            stored = sum(
                r.get_sample_value("iop_edge_batch_lines_total", {"outcome": "failed"}) or 0
                for r in registries
            )
            lines = 3 * len(granted)
            print(
                f"line runs: {len(runs)} (each line through both edges at once); "
                f"refused: {errors}; lines stored: {int(stored)} of {lines} leased lines"
            )

            tracemalloc.start()
            digest = hashlib.sha256()
            started = time.perf_counter()
            async with a.receive_file() as upload:
                for n in range(mib * 4):
                    piece = n.to_bytes(4, "big") * (MIB // 16)
                    digest.update(piece)
                    await upload.write(piece)
                big = await a.create_file(upload, "big.jsonl", "batch")
            upload_s = time.perf_counter() - started
            _, upload_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            started = time.perf_counter()
            try:
                content = await b.file_content(big["id"])
                back = hashlib.sha256()
                async for chunk in content.chunks():
                    back.update(chunk)
                same = back.hexdigest() == digest.hexdigest()
                read = f"read through B: identical={same}"
            except Exception as error:
                read = f"read through B: {type(error).__name__}"
            read_s = time.perf_counter() - started
            _, read_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            print(
                f"upload {mib} MiB through A: {mib / upload_s:.0f} MiB/s, peak traced "
                f"{upload_peak / MIB:.1f} MiB; {read} ({mib / read_s:.0f} MiB/s, peak "
                f"{read_peak / MIB:.1f} MiB)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(measure(args.batches, args.mib))


if __name__ == "__main__":
    main()
