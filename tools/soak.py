"""Soak the real stack: a fixed request rate for minutes while nodes restart at random.

``make soak`` (not in CI). Starts control-plane, edge, node-a, node-b and the worker as
processes with mTLS from a throwaway CA, like ``tests/conftest.py`` (this is a
copy of its few lines, not an import: tools do not depend on tests), then drives an
open-loop load of streamed and plain chat requests at ``--rate`` for ``--duration``
while restarting a random node every ``--restart-every`` seconds (SIGTERM or SIGKILL).

Two things leak only over time, so this is where they show:

* lost requests: every request must end with an answer or an OpenAI error object.
  One that hangs past ``--request-timeout``, or ends any other way (a reset, a
  stream without ``[DONE]``, a status without an error body), is LOST. Any lost
  request makes the exit code 1.
* memory: each service's RSS (``/proc/<pid>/status`` VmRSS) every 5 s, reported as a
  least-squares slope in MB per minute, over the whole run and after a warm-up.

Open loop (requests start on schedule, whether or not earlier ones finished) on purpose:
a closed loop slows down when the stack does and hides the requests it would have lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import trustme
import yaml

from iop_proto.testing import write_identity

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ROLES = {
    "control-plane": "control-plane",
    "edge": "edge",
    "node-a": "node",
    "node-b": "node",
    "worker": "worker",
}
SCRIPTS = {"control-plane": "iop-control-plane", "edge": "iop-edge", "worker": "iop-worker"}
NODES = ("node-a", "node-b")
RSS_EVERY_S = 5.0
# "ready: edge admin http://127.0.0.1:PORT ports {"http": PORT, ...}": every listener
# binds port 0 and the ready line says what it got.
READY = re.compile(r"ready: \S+ admin (http://\S+)(?: ports (\{.*?\}))?")


def mock(provider_id: str, served: str) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": [served],
        "capacity": 8,  # one node alone must carry the whole rate while the other restarts
        "max_queue": 32,
        "queue_timeout_ms": 10_000,
        "request_timeout_ms": 20_000,
        "tokens_per_second": 100,
    }


FLEET = {
    "models": [
        {"id": "mock-small", "providers": {"node-a-mock": "mock-small", "node-b-mock": "mock-b"}}
    ],
    "nodes": [
        {"id": "node-a", "providers": [mock("node-a-mock", "mock-small")]},
        {"id": "node-b", "providers": [mock("node-b-mock", "mock-b")]},
    ],
}


# ---------------------------------------------------------------- processes


@dataclass
class Service:
    """One service process; its stderr goes to a log file and is watched for lines."""

    name: str
    config: Path
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    pids: list[int] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)  # bound listeners, from the ready line
    _waiters: list[tuple[str, asyncio.Future[str]]] = field(default_factory=list)
    _pump: asyncio.Task[None] | None = None

    def expect(self, text: str) -> asyncio.Future[str]:
        """A future for the next log line containing ``text`` (ask before causing it)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.append((text, future))
        return future

    async def start(self) -> None:
        ready = self.expect("ready: ")
        self.process = await asyncio.create_subprocess_exec(
            str(BIN / SCRIPTS.get(self.name, "iop-node")),
            "--config",
            str(self.config),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C reaches the soak only; it stops them in order
        )
        self.pids.append(self.process.pid)
        assert self.process.stderr is not None
        self._pump = asyncio.create_task(self._read(self.process.stderr), name=f"log:{self.name}")
        line = await asyncio.wait_for(ready, 30)
        match = READY.search(line)
        if match is None:
            raise RuntimeError(f"{self.name}: unexpected readiness line {line!r}")
        self.ports = json.loads(match.group(2) or "{}")

    async def _read(self, stream: asyncio.StreamReader) -> None:
        with self.log_path.open("a") as log:
            while raw := await stream.readline():
                line = raw.decode(errors="replace")
                log.write(line)
                for entry in list(self._waiters):
                    if entry[0] in line:
                        self._waiters.remove(entry)
                        if not entry[1].done():
                            entry[1].set_result(line)
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(RuntimeError(f"{self.name} exited (see {self.log_path})"))
        self._waiters.clear()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def stop(self, signal_number: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal_number)
        try:
            code = await asyncio.wait_for(self.process.wait(), 30)
        except TimeoutError:
            self.process.kill()
            code = await self.process.wait()
        if self._pump is not None:
            await self._pump
        return code


@dataclass
class Stack:
    root: Path
    api_url: str = ""
    services: dict[str, Service] = field(default_factory=dict)

    def settings(self, name: str, data: dict[str, object]) -> Path:
        pki = self.root / "pki"
        tls = {
            "ca_file": str(pki / "ca.pem"),
            "cert_file": str(pki / f"{name}.pem"),
            "key_file": str(pki / f"{name}.key"),
        }
        path = self.root / f"{name}.yaml"
        base = {"service_id": name, "admin": {"host": "127.0.0.1", "port": 0}, "tls": tls}
        path.write_text(yaml.safe_dump({**base, **data}))
        self.services[name] = Service(name, path, self.root / "logs" / f"{name}.log")
        return path

    async def issue_token(self, node: str) -> str:
        return await self._issue(r"iopnt_\S+", "token", "issue", "--node", node)

    async def issue_key(self, name: str) -> str:
        """A plain API key (no operator flag, every model) from the control-plane's CLI."""
        return await self._issue(r"sk-iop-\S+", "key", "issue", "--name", name)

    async def _issue(self, secret: str, *command: str) -> str:
        """Runs the control-plane's CLI ``command``; the secret it prints (``secret``)."""
        process = await asyncio.create_subprocess_exec(
            str(BIN / "iop-control-plane"),
            "--config",
            str(self.root / "control-plane.yaml"),
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        found = re.search(secret, out.decode())
        if process.returncode != 0 or found is None:
            raise RuntimeError(f"{' '.join(command)} failed: {err.decode()}")
        return found.group(0)

    async def start(self) -> None:
        """Write the PKI, fleet and settings, then start each service once the previous is up."""
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        for name, role in ROLES.items():
            write_identity(ca, self.root / "pki", name, role)
        fleet_file = self.root / "fleet.yaml"
        fleet_file.write_text(yaml.safe_dump(FLEET))
        self.settings(
            "control-plane",
            {
                "fleet_file": str(fleet_file),
                "database": str(self.root / "cp.db"),
                "listen": {"host": "127.0.0.1", "port": 0},
            },
        )
        await self.services["control-plane"].start()
        cp_port = self.services["control-plane"].ports["edges"]
        self.settings(
            "edge",
            {
                "http": {"host": "127.0.0.1", "port": 0},
                "node_listener": {"host": "127.0.0.1", "port": 0},
                "control_plane": {"host": "127.0.0.1", "port": cp_port, "server_name": "localhost"},
                "config_cache": str(self.root / "edge-cache.pb"),
                "history_db": str(self.root / "edge-runs.db"),
                "responses_db": str(self.root / "edge-responses.db"),
                "batch_db": str(self.root / "edge-batches.db"),
            },
        )
        edge = self.services["edge"]
        await edge.start()  # only nodes restart: the edge keeps the ports it bound
        self.api_url = f"http://127.0.0.1:{edge.ports['http']}/v1"
        dial = {"host": "127.0.0.1", "port": edge.ports["nodes"], "server_name": "localhost"}
        self.settings("worker", {"edge": dial, "reconnect": {"initial_s": 0.1, "max_s": 0.5}})
        for node in NODES:
            node_settings: dict[str, object] = {
                "edge": dial,
                "token": await self.issue_token(node),
                "history_db": str(self.root / f"{node}-history.db"),
                "probes": {"interval_s": 0.5},
                "reconnect": {"initial_s": 0.1, "max_s": 0.5},
            }
            self.settings(node, node_settings)
            await self.restart_node(node, None)
        registered = self.services["edge"].expect("worker worker registered")
        await self.services["worker"].start()
        await asyncio.wait_for(registered, 30)

    async def restart_node(self, node: str, signal_number: int | None) -> float:
        """Stop ``node`` (unless ``signal_number`` is None) and start it; returns the seconds
        from the stop to the edge logging its registration."""
        began = time.monotonic()
        if signal_number is not None:
            await self.services[node].stop(signal_number)
        registered = self.services["edge"].expect(f"node {node} registered")
        await self.services[node].start()
        await asyncio.wait_for(registered, 30)
        return time.monotonic() - began

    async def stop(self) -> None:
        for service in reversed(self.services.values()):
            if service.process is not None:
                await service.stop()


# ---------------------------------------------------------------- load


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # completed | error | lost
    details: Counter[str] = field(default_factory=Counter)  # error codes and loss reasons
    latencies_ms: list[float] = field(default_factory=list)


def _error_code(payload: Any) -> str | None:
    """The code of an OpenAI error object, or None when ``payload`` is not one."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error.get("code") or error.get("type") or "error")
    return None


async def _plain(response: aiohttp.ClientResponse) -> tuple[str, str]:
    payload = await response.json(content_type=None)
    if response.status == 200:
        choices = payload.get("choices") or [{}]
        if choices[0].get("finish_reason") and "message" in choices[0]:
            return "completed", ""
        return "lost", "200 without a finished choice"
    code = _error_code(payload)
    return ("error", code) if code else ("lost", f"{response.status} without an error object")


async def _stream(response: aiohttp.ClientResponse) -> tuple[str, str]:
    if response.status != 200:
        return await _plain(response)
    finished = False
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return ("completed", "") if finished else ("lost", "[DONE] before a finish_reason")
        chunk = json.loads(data)
        if (code := _error_code(chunk)) is not None:
            return "error", f"{code} (mid-stream)"
        if any(c.get("finish_reason") for c in chunk.get("choices", [])):
            finished = True
    return "lost", "stream ended without [DONE]"


async def one_request(
    http: aiohttp.ClientSession, api_url: str, stream: bool, max_tokens: int, timeout_s: float
) -> tuple[str, str]:
    body: dict[str, Any] = {
        "model": "mock-small",
        "messages": [{"role": "user", "content": "soak"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "iop_mock": {"fill": True},  # the mock answers max_tokens tokens: the load asked for
    }
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{api_url}/chat/completions", json=body) as response:
                return await (_stream(response) if stream else _plain(response))
    except TimeoutError:
        return "lost", f"no end within {timeout_s:.0f}s"
    except Exception as exc:  # the per-request boundary: any other end is a lost answer
        return "lost", f"{type(exc).__name__}: {exc}"[:120]


async def drive(
    args: argparse.Namespace, stack: Stack, rng: random.Random, stop: asyncio.Event
) -> Tally:
    """Start requests on a fixed schedule until the duration ends; wait for the stragglers."""
    tally = Tally()
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)  # a pool limit would queue, not lose, requests
    async with aiohttp.ClientSession(connector=connector) as http:

        async def run(stream: bool, max_tokens: int) -> None:
            began = loop.time()
            outcome, detail = await one_request(
                http, stack.api_url, stream, max_tokens, args.request_timeout
            )
            tally.outcomes[outcome] += 1
            if detail:
                tally.details[f"{outcome}: {detail}"] += 1
            if outcome == "completed":
                tally.latencies_ms.append((loop.time() - began) * 1000)

        start = loop.time()
        for i in range(int(args.duration * args.rate)):
            at = start + i / args.rate
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, at - loop.time()))
            if stop.is_set():
                break
            task = asyncio.create_task(run(rng.random() < args.stream_share, rng.randint(8, 64)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return tally


async def restart_nodes(
    args: argparse.Namespace, stack: Stack, rng: random.Random, done: asyncio.Event, out: TextIO
) -> list[str]:
    """Every ~``--restart-every`` s, a random node, SIGTERM or SIGKILL; never cut mid-restart."""
    events: list[str] = []
    began = time.monotonic()
    delay = args.restart_every * rng.uniform(0.4, 0.6)
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), delay)
        if done.is_set():
            return events
        node, sig = rng.choice(NODES), rng.choice((signal.SIGTERM, signal.SIGKILL))
        at = time.monotonic() - began
        try:
            back_s = await stack.restart_node(node, sig)
        except (RuntimeError, TimeoutError) as exc:  # reported; the node shows as not running
            events.append(f"{at:5.0f}s {node} {sig.name}: did not come back ({exc!r})")
            print(f"soak: {events[-1]}", file=out, flush=True)
            return events
        events.append(f"{at:5.0f}s {node} {sig.name}: registered again after {back_s:.2f}s")
        print(f"soak: {events[-1]}", file=out, flush=True)
        delay = args.restart_every * rng.uniform(0.75, 1.25)


def rss_kb(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else None


async def sample_rss(stack: Stack, done: asyncio.Event, samples: dict[str, list[Any]]) -> None:
    """(minutes since start, pid, MB) for each live service every ``RSS_EVERY_S``."""
    began = time.monotonic()
    while not done.is_set():
        for name, service in stack.services.items():
            if service.alive and service.process is not None:
                kb = rss_kb(service.process.pid)
                if kb is not None:
                    minutes = (time.monotonic() - began) / 60
                    samples[name].append((minutes, service.process.pid, kb / 1024))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), RSS_EVERY_S)


# ---------------------------------------------------------------- report


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope (MB per minute) of (minute, MB) points; None under 3 points."""
    if len(points) < 3:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def rss_table(samples: dict[str, list[Any]], warmup_min: float) -> list[str]:
    """Per service: the slope of its longest-lived process (a restarted node starts anew)."""
    rows = ["  service        procs  start MB  end MB  max MB  MB/min  MB/min after warm-up"]
    for name, points in sorted(samples.items(), key=lambda item: list(ROLES).index(item[0])):
        by_pid: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for minutes, pid, mb in points:
            by_pid[pid].append((minutes, mb))
        longest = max(by_pid.values(), key=len)
        late = [(x, y) for x, y in longest if x >= longest[0][0] + warmup_min]
        rows.append(
            f"  {name:<14} {len(by_pid):>5} {longest[0][1]:>9.1f} {longest[-1][1]:>7.1f} "
            f"{max(y for _, y in longest):>7.1f}  {fmt(slope(longest))}  {fmt(slope(late)):>20}"
        )
    return rows


def fmt(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:+6.2f}"


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


async def soak(args: argparse.Namespace, out: TextIO) -> int:
    root = args.workdir or REPO / "var" / "soak" / time.strftime("%Y%m%d-%H%M%S")
    stack = Stack(Path(root))
    rng = random.Random(args.seed)
    stop, done = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)  # end the load early, still report
    samples: dict[str, list[Any]] = defaultdict(list)
    try:
        print(f"soak: starting the stack in {stack.root}", file=out, flush=True)
        try:
            await stack.start()
        except (RuntimeError, TimeoutError) as exc:
            print(f"soak: the stack did not start: {exc!r}", file=out, flush=True)
            return 2
        print(
            f"soak: {args.duration:.0f}s at {args.rate:g} req/s "
            f"({args.stream_share:.0%} streamed) against {stack.api_url}, "
            f"a node restart every ~{args.restart_every:.0f}s",
            file=out,
            flush=True,
        )
        sampler = asyncio.create_task(sample_rss(stack, done, samples))
        restarter = asyncio.create_task(restart_nodes(args, stack, rng, done, out))
        load_began = time.monotonic()
        try:
            tally = await drive(args, stack, rng, stop)
        finally:
            load_s = time.monotonic() - load_began
            done.set()
            restarts = await restarter
            await sampler
        died = [name for name, service in stack.services.items() if not service.alive]
    finally:
        await stack.stop()
    if stop.is_set():
        print(f"\nsoak: interrupted after {load_s:.0f}s of load", file=out)

    print_report(out, args, tally, load_s, restarts, samples, stack.root / "logs")
    if died:
        print(f"FAILED: services not running at the end: {', '.join(died)}", file=out)
    print(f"LOST REQUESTS: {tally.outcomes['lost']}", file=out, flush=True)
    if tally.outcomes["lost"] or died:
        return 1
    return 130 if stop.is_set() else 0  # an interrupted soak proves nothing


def print_report(
    out: TextIO,
    args: argparse.Namespace,
    tally: Tally,
    load_s: float,
    restarts: list[str],
    samples: dict[str, list[Any]],
    logs: Path,
) -> None:
    lat = tally.latencies_ms
    print(
        f"\nsoak: {sum(tally.outcomes.values())} requests in {load_s:.0f}s: "
        f"{tally.outcomes['completed']} completed, {tally.outcomes['error']} OpenAI errors, "
        f"{tally.outcomes['lost']} lost (logs in {logs})",
        file=out,
    )
    for detail, count in tally.details.most_common():
        print(f"  {count:>6}  {detail}", file=out)
    print(
        f"latency of completed: p50 {percentile(lat, 0.5):.0f} ms, "
        f"p99 {percentile(lat, 0.99):.0f} ms, max {max(lat, default=0):.0f} ms",
        file=out,
    )
    print(f"node restarts: {len(restarts)}", file=out)
    for event in restarts:
        print(f"  {event}", file=out)
    warmup_min = min(1.0, args.duration / 5 / 60)
    print(
        f"RSS slope per service (least squares over {RSS_EVERY_S:.0f}s samples; "
        f"warm-up {warmup_min * 60:.0f}s):",
        file=out,
    )
    for row in rss_table(samples, warmup_min):
        print(row, file=out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--stream-share", type=float, default=0.5, help="share streamed")
    parser.add_argument("--restart-every", type=float, default=60.0, help="seconds, about")
    parser.add_argument("--request-timeout", type=float, default=30.0, help="LOST after this")
    parser.add_argument("--seed", type=int, default=None, help="for restarts and request mix")
    parser.add_argument("--workdir", type=Path, default=None, help="default var/soak/<time>")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(soak(parse_args(argv), sys.stdout))


if __name__ == "__main__":
    sys.exit(main())
