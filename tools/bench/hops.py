"""Count the hops of one streamed chat completion: the IOP functions it runs, in order.

    .venv/bin/python tools/bench/hops.py [--json OUT] [--window 1.0] [--rounds 3]

Starts the benchmark's stack of real processes (the fake backend, a control-plane,
the edge, one node with the ``openai_api`` adapter in front of the fake), warms it
with a few streams, then, per round:

1. an **idle window**: call tracing on in the edge and the node for ``--window``
   seconds with no request, then off: what runs there is the services' own
   background (heartbeats, probes, snapshots, metrics);
2. a **request window** of the same length: tracing on, one streamed chat
   completion (4 tokens), the rest of the window for what the request leaves to
   do after its last byte (the run log's and the history's batched writes), off.

A function is on the path when the request window ran it more often (calls plus
resumptions) than the idle window did, in every round: a function that only
background work ran is left out, one that both run (a frame's encoder) stays, and
a periodic task that happened to fire in one request window is not counted (it is
listed as unstable). The node's probes are set to once an hour for the same reason
(a probe every 2 s, the benchmark's, would land in every other window). Tracing is
``hops_hook/sitecustomize.py``, loaded into the stack's processes through their
``PYTHONPATH`` and switched by SIGUSR1 / SIGUSR2; the services' code is unchanged.
Only functions of ``iop_edge``, ``iop_node`` and ``iop_proto`` are recorded, not the
generated ``iop_proto.v1``, the standard library or aiohttp.

The request carries a prompt of about 2 KB, so that its body is told from a stream
chunk by size: the hook also lists every JSON parse and serialisation of at least
``BODY_MIN_BYTES`` in the request window, with the IOP function that asked for it
(``json`` and ``orjson`` are wrapped in the traced processes; their code is unchanged).

Printed: the number of distinct functions on the path (edge + node), the path in
the order each function first ran (edge, then node) with its calls, the functions
on it that write the body's ``model`` (``hops_source.py`` says how they are
recognised) with how many times each ran, and how many times the body was parsed
and serialised, per process, by which functions.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

# Run as a script (``tools/bench/hops.py``): tools/ holds the ``bench`` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backends import fake_backend
from bench.client import Target, session, stream
from bench.hops_source import model_writes
from bench.stack import ProviderSpec, start_iop

HOOK_DIR: Final = Path(__file__).resolve().parent / "hops_hook"
PROCESSES: Final = ("edge", "node")
MODEL: Final = "fake"
TOKENS: Final = 4
WARM_STREAMS: Final = 5
PROBE_INTERVAL_S: Final = 3600.0  # the node probes once as it starts, then not while traced
SIGNAL_TIMEOUT_S: Final = 10.0
PROMPT: Final = [
    {"role": "system", "content": "You count hops. " * 16},
    {"role": "user", "content": "How many functions does this request run? " * 48},
]
"""About 2.3 KB of text: a body parse or serialisation is at least that, a chunk ~200 B."""
BODY_MIN_BYTES: Final = 2048

Record = list[dict[str, Any]]  # one process's functions, in the order they first ran
JsonCalls = list[dict[str, Any]]  # one process's body-sized JSON parses and serialisations


async def _wait_file(path: Path, timeout_s: float = SIGNAL_TIMEOUT_S) -> None:
    """Until the hook in the service wrote ``path`` (its answer to a signal)."""
    async with asyncio.timeout(timeout_s):
        while not await asyncio.to_thread(path.exists):  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.01)


class Tracer:
    """Switches the hook of each traced process and reads what it recorded."""

    def __init__(self, trace_dir: Path, pids: dict[str, int]) -> None:
        self._dir = trace_dir
        self._pids = pids
        self._seq = 0  # the hook counts its SIGUSR1s the same way

    async def window(
        self, seconds: float, action: Callable[[], Awaitable[None]] | None
    ) -> tuple[dict[str, Record], dict[str, JsonCalls]]:
        """Trace every process for ``seconds``, running ``action`` at the start: the
        functions each ran, and its body-sized JSON calls."""
        self._seq += 1
        for pid in self._pids.values():
            os.kill(pid, signal.SIGUSR1)
        for pid in self._pids.values():
            await _wait_file(self._dir / f"on-{pid}-{self._seq}")
        loop = asyncio.get_running_loop()
        started = loop.time()
        if action is not None:
            await action()
        busy = loop.time() - started
        if busy > seconds / 2:
            raise RuntimeError(f"the request took {busy:.2f} s: use a --window over {2 * busy:.1f}")
        await asyncio.sleep(seconds - busy)  # the window's length is the measurement's unit
        for pid in self._pids.values():
            os.kill(pid, signal.SIGUSR2)
        records: dict[str, Record] = {}
        calls: dict[str, JsonCalls] = {}
        for name, pid in self._pids.items():
            path = self._dir / f"rec-{pid}-{self._seq}.json"
            await _wait_file(path)
            recorded = json.loads(path.read_text())
            records[name], calls[name] = recorded["functions"], recorded["json"]
        return records, calls


def _key(entry: dict[str, Any]) -> str:
    return f"{entry['module']}:{entry['qualname']}"


def _activity(entry: dict[str, Any] | None) -> int:
    return 0 if entry is None else int(entry["calls"]) + int(entry["resumes"])


def merged(record: Record) -> dict[str, dict[str, Any]]:
    """The record by function name, in order; two code objects of one name are summed."""
    by_key: dict[str, dict[str, Any]] = {}
    for entry in record:
        key = _key(entry)
        if key in by_key:
            by_key[key]["calls"] += entry["calls"]
            by_key[key]["resumes"] += entry["resumes"]
        else:
            by_key[key] = dict(entry)
    return by_key


def request_path(request: Record, idle: Record) -> tuple[list[str], list[str]]:
    """The request's functions (run more often than in the idle window), and the rest."""
    ran, background = merged(request), merged(idle)
    path = [k for k, e in ran.items() if _activity(e) > _activity(background.get(k))]
    return path, [k for k in ran if k not in path]


@dataclass
class Round:
    """One idle window and the request window after it: what each process recorded."""

    idle: dict[str, Record]
    request: dict[str, Record]
    body_json: dict[str, JsonCalls]
    """The request window's body-sized JSON parses and serialisations, per process."""


async def measure(window_s: float, rounds: int) -> list[Round]:
    """Start the stack, warm it, trace ``rounds`` pairs of an idle and a request window."""
    with tempfile.TemporaryDirectory(prefix="iop-hops-") as scratch:
        root = Path(scratch)
        trace_dir = root / "trace"
        trace_dir.mkdir()
        # Read by the hook in every child (not IOP_*: the services read those as settings).
        os.environ["BENCH_HOPS_DIR"] = str(trace_dir)
        os.environ["BENCH_HOPS_BODY_MIN"] = str(BODY_MIN_BYTES)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p
        )
        async with fake_backend(root / "fake.log", MODEL) as (fake_url, _):
            spec = ProviderSpec("bench-fake", "openai_api", "api", (MODEL,), endpoint=fake_url)
            stack = start_iop(root / "iop", [spec], probe_interval_s=PROBE_INTERVAL_S)
            async with stack as iop, session(4) as http:
                target = Target("iop", iop.api_url, MODEL)

                async def one_stream() -> None:
                    await stream(http, target, TOKENS, timed=False, messages=PROMPT)

                for _ in range(WARM_STREAMS):
                    await one_stream()
                # The last warm-up stream's batched writes (run log, history) are done
                # within a window; the first idle window must not see them.
                await asyncio.sleep(window_s)
                roots = iop.gateway().roots
                tracer = Tracer(trace_dir, {name: roots[name] for name in PROCESSES})
                done = []
                for _ in range(rounds):
                    idle, _ = await tracer.window(window_s, None)
                    request, body_json = await tracer.window(window_s, one_stream)
                    done.append(Round(idle, request, body_json))
                return done


def _rewrites(path: dict[str, Record]) -> list[dict[str, Any]]:
    found = []
    for process, entries in path.items():
        for entry in entries:
            lines = model_writes(entry["file"], entry["line"])
            if lines:
                found.append(
                    {
                        "process": process,
                        "function": _key(entry),
                        "calls": entry["calls"],
                        "lines": lines,
                    }
                )
    return found


def _body_ops(calls: dict[str, JsonCalls], op: str) -> dict[str, Any]:
    """How many times one round's request body was parsed (or serialised), and by whom."""
    by: collections.Counter[tuple[str, str, str]] = collections.Counter()
    size: dict[tuple[str, str, str], int] = {}
    for process, entries in calls.items():
        for entry in entries:
            if entry["op"] == op:
                key = (process, entry["function"], entry["library"])
                by[key] += 1
                size[key] = max(size.get(key, 0), entry["bytes"])
    return {
        "total": sum(by.values()),
        **{process: sum(n for k, n in by.items() if k[0] == process) for process in PROCESSES},
        "by": [
            {"process": p, "function": f, "library": lib, "times": n, "bytes": size[p, f, lib]}
            for (p, f, lib), n in by.items()
        ],
    }


def body_json(rounds: list[Round]) -> dict[str, Any]:
    """The first round's body parses and serialisations; ``stable``: every round agrees."""
    per_round = [{op: _body_ops(r.body_json, op) for op in ("parse", "serialise")} for r in rounds]
    return {
        "min_bytes": BODY_MIN_BYTES,
        "parsed": per_round[0]["parse"],
        "serialised": per_round[0]["serialise"],
        "stable": all(r == per_round[0] for r in per_round[1:]),
    }


def report(rounds: list[Round], window_s: float) -> dict[str, Any]:
    """The path every round agrees on (the first round's order and counts), and the rest.

    A function on the path in some rounds only is reported as unstable, not counted: a
    periodic task that fired in one request window and not in the idle window before
    it would be one; the request's own functions run in every round.
    """
    path: dict[str, Record] = {}
    unstable: dict[str, dict[str, int]] = {}
    left_out: dict[str, list[str]] = {}
    idle: dict[str, list[str]] = {}
    for name in PROCESSES:
        idle[name] = sorted({k for r in rounds for k in merged(r.idle[name])})
        splits = [request_path(r.request[name], r.idle[name]) for r in rounds]
        first = merged(rounds[0].request[name])
        seen = collections.Counter(k for keys, _ in splits for k in keys)
        path[name] = [first[k] for k in splits[0][0] if seen[k] == len(rounds)]
        unstable[name] = {k: n for k, n in seen.items() if n < len(rounds)}
        left_out[name] = sorted({k for _, out in splits for k in out} - set(seen))
    return {
        "request": f"one streamed chat completion ({TOKENS} tokens; openai_api adapter, fake "
        "backend)",
        "window_s": window_s,
        "rounds": len(rounds),
        "filter": "left out: what ran at least as often in an idle window of the same length "
        "just before (heartbeats, probes, snapshots); counted: what every round ran",
        "hops": {"total": sum(map(len, path.values())), **{n: len(p) for n, p in path.items()}},
        "modules": {n: len({e["module"] for e in p}) for n, p in path.items()},
        "path": path,
        "model_rewrites": _rewrites(path),
        "body_json": body_json(rounds),
        "idle_ran": idle,
        "background_left_out": left_out,
        "unstable": unstable,
    }


def render(result: dict[str, Any]) -> str:
    hops = result["hops"]
    left_out = ", ".join(f"{n} {len(v)}" for n, v in result["background_left_out"].items())
    idle = ", ".join(f"{n} {len(v)}" for n, v in result["idle_ran"].items())
    lines = [
        f"hops of {result['request']}",
        f"{result['rounds']} rounds of {result['window_s']:g} s windows; {result['filter']}",
        f"idle windows ran: {idle} functions; left out of the path: {left_out}",
        f"hops: {hops['total']} distinct IOP functions (edge {hops['edge']}, node {hops['node']})"
        f" in {' + '.join(str(n) for n in result['modules'].values())} modules",
    ]
    for name in PROCESSES:
        lines.append(f"{name} path:")
        for i, entry in enumerate(result["path"][name], start=1):
            resumes = f" (+{entry['resumes']} resumes)" if entry["resumes"] else ""
            lines.append(f"  {i:3d}  {_key(entry)}  x{entry['calls']}{resumes}")
    rewrites = result["model_rewrites"]
    total = sum(r["calls"] for r in rewrites)
    lines.append(f"model written in the request body: {total} times, by {len(rewrites)} functions")
    for r in rewrites:
        lines.append(f"  {r['process']}: {r['function']} x{r['calls']} (line {r['lines']})")
    body = result["body_json"]
    for op, verb in (("parsed", "parsed"), ("serialised", "serialised")):
        counts = body[op]
        split = ", ".join(f"{name} {counts[name]}" for name in PROCESSES)
        lines.append(f"body {verb}: {counts['total']} times ({split})")
        for row in counts["by"]:
            lines.append(
                f"  {row['process']}: {row['function']} x{row['times']}"
                f" ({row['library']}, {row['bytes']} bytes)"
            )
    if not body["stable"]:
        lines.append("body parses/serialisations differed between rounds: the first is shown")
    for name, keys in result["unstable"].items():
        for key, n in keys.items():
            lines.append(f"unstable, not counted: {name} {key} (on the path in {n} rounds)")
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--window", type=float, default=1.0, help="seconds per traced window")
    parser.add_argument("--rounds", type=int, default=3, help="idle + request windows, repeated")
    args = parser.parse_args()
    result = report(asyncio.run(measure(args.window, max(1, args.rounds))), args.window)
    print(render(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    cli()
