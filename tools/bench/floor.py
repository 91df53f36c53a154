"""The floor under IOP's figures: its design alone, and its libraries alone, beside IOP.

IOP is two Python processes between a client and a provider, mutual TLS between the
two, aiohttp serving HTTP in the edge and calling providers in the node. This
scenario measures what that shape costs with no work in it, in the same run as IOP
and alternating with it, so that IOP's overhead splits into what its design costs,
what its libraries cost and what its own code costs:

- ``direct``: the fake backend (a fake of its own, not the other scenarios');
- ``design``: two byte relays with mutual TLS between them (``relay.py``: uvloop,
  IOP's TLS contexts and identities, nothing parsed);
- ``libraries``: the same two hops made of IOP's libraries (``passthrough.py``: an
  aiohttp server, one mutual-TLS link of length-prefixed frames, an aiohttp client
  session), no routing, protobuf, queue, history or metrics;
- ``iop``: a real IOP stack (control-plane, edge, node with the ``openai_api`` adapter).

Rows: added p50 at c=1 (target <= 1.0 ms), throughput at c=64 as a share of direct's
(target >= 0.5x) and CPU per request at c=64 (the variant's own processes; for IOP,
the edge and the node), each for the three. The client and the fake are the same
processes for every target.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import trustme

from iop_proto.testing import write_identity

from .backends import fake_backend
from .client import Target, closed_loop, complete, percentile, rotated, session
from .procs import cpu_seconds, spawn
from .results import Row, ScenarioResult, ratio
from .stack import ProviderSpec, start_iop

SCENARIO = "floor"
HERE = Path(__file__).resolve().parent
RELAY_READY = re.compile(r"relay on (\d+)")
EDGE_READY = re.compile(r"passthrough on (\d+) link (\d+)")
NODE_READY = re.compile(r"passthrough linked")
NAMES = ("direct", "design", "libraries", "iop")
LABELS = {
    "design": "design alone (2 byte relays, mTLS)",
    "libraries": "libraries alone (aiohttp, mTLS link, aiohttp client)",
    "iop": "IOP",
}
ADDED_P50_TARGET_MS = 1.0
THROUGHPUT_TARGET = 0.5


@dataclass(frozen=True)
class Settings:
    warmup: int
    pairs: int  # rounds at c=1 (each target once per round)
    rounds: int  # rounds at c=64
    seconds: float  # per target per c=64 round


@dataclass
class _Variants:
    """Where each target listens, and the pids whose CPU is its own."""

    targets: dict[str, Target]
    pids: dict[str, list[int]]


async def _relays(
    stack: contextlib.AsyncExitStack, root: Path, fake: str, pki: Path
) -> tuple[int, list[int]]:
    """The design: outer relay -> mTLS -> inner relay -> fake; the outer one's port and
    both pids."""
    script = [sys.executable, str(HERE / "relay.py")]
    inner = await stack.enter_async_context(
        spawn(
            [*script, "--upstream", fake, "--listen-tls", str(pki)],
            ready=RELAY_READY,
            log=root / "relay-inner.log",
        )
    )
    upstream = f"127.0.0.1:{inner.match.group(1)}"
    outer = await stack.enter_async_context(
        spawn(
            [*script, "--upstream", upstream, "--upstream-tls", str(pki)],
            ready=RELAY_READY,
            log=root / "relay-outer.log",
        )
    )
    return int(outer.match.group(1)), [inner.process.pid, outer.process.pid]


async def _passthrough(
    stack: contextlib.AsyncExitStack, root: Path, fake_url: str, pki: Path
) -> tuple[int, list[int]]:
    """The libraries: passthrough edge <- mTLS link <- passthrough node -> fake; the
    edge's HTTP port and both pids."""
    script = [sys.executable, str(HERE / "passthrough.py"), "--tls", str(pki)]
    edge = await stack.enter_async_context(
        spawn([*script, "--role", "edge"], ready=EDGE_READY, log=root / "libraries-edge.log")
    )
    link = f"127.0.0.1:{edge.match.group(2)}"
    node = await stack.enter_async_context(
        spawn(
            [*script, "--role", "node", "--upstream", link, "--provider", fake_url],
            ready=NODE_READY,
            log=root / "libraries-node.log",
        )
    )
    return int(edge.match.group(1)), [edge.process.pid, node.process.pid]


def _identities(directory: Path) -> Path:
    """The relays' and the passthrough's certificates (IOP's edge and node roles)."""
    ca = trustme.CA()
    write_identity(ca, directory, "edge", "edge")
    write_identity(ca, directory, "node-a", "node")
    return directory


async def run(root: Path, settings: Settings) -> ScenarioResult:
    """Start the four targets, measure them alternating, stop them."""
    pki = _identities(root / "pki")
    async with contextlib.AsyncExitStack() as stack:
        fake_url, fake_pid = await stack.enter_async_context(fake_backend(root / "fake.log"))
        design, design_pids = await _relays(stack, root, fake_url.removeprefix("http://"), pki)
        libraries, libraries_pids = await _passthrough(stack, root, fake_url, pki)
        spec = ProviderSpec("bench-fake", "openai_api", "api", ("fake",), endpoint=fake_url)
        iop = await stack.enter_async_context(start_iop(root / "iop", [spec]))
        variants = _Variants(
            targets={
                "direct": Target("direct", f"{fake_url}/v1", "fake"),
                "design": Target("design", f"http://127.0.0.1:{design}/v1", "fake"),
                "libraries": Target("libraries", f"http://127.0.0.1:{libraries}/v1", "fake"),
                "iop": Target("iop", iop.api_url, "fake"),
            },
            pids={
                "client": [os.getpid()],
                "fake": [fake_pid],
                "design": design_pids,
                "libraries": libraries_pids,
                "iop": iop.gateway().pids(),
            },
        )
        data = await _measure(variants, settings)
    return _result(data, settings)


async def _measure(variants: _Variants, settings: Settings) -> dict[str, dict[str, float]]:
    targets = variants.targets
    latency: dict[str, list[float]] = {name: [] for name in NAMES}
    done = dict.fromkeys(NAMES, 0)
    failed = dict.fromkeys(NAMES, 0)
    elapsed = dict.fromkeys(NAMES, 0.0)
    cpu = {name: dict.fromkeys(variants.pids, 0.0) for name in NAMES}
    async with session(64) as http:
        for name in NAMES:
            for _ in range(settings.warmup):
                await complete(http, targets[name])
        for i in range(settings.pairs):
            for name in rotated(NAMES, i):
                latency[name].append(await complete(http, targets[name]))
        for name in NAMES:  # the 64 connections (a relay's TLS handshakes) before timing
            await closed_loop(http, targets[name], 64, 0.2)
        for i in range(settings.rounds):
            for name in rotated(NAMES, i):
                before = {group: cpu_seconds(pids) for group, pids in variants.pids.items()}
                completed, lost, took = await closed_loop(http, targets[name], 64, settings.seconds)
                for group, pids in variants.pids.items():
                    cpu[name][group] += cpu_seconds(pids) - before[group]
                done[name] += completed
                failed[name] += lost
                elapsed[name] += took
    out: dict[str, dict[str, float]] = {}
    for name in NAMES:
        requests = max(done[name], 1)
        out[name] = {
            "p50_ms": percentile(latency[name], 50) * 1000,
            "p99_ms": percentile(latency[name], 99) * 1000,
            "c64_rps": done[name] / elapsed[name] if elapsed[name] else float("nan"),
            "c64_done": done[name],
            "c64_failed": failed[name],
            **{f"cpu_us_{group}": cpu[name][group] / requests * 1e6 for group in variants.pids},
        }
    return out


def _result(data: dict[str, dict[str, float]], settings: Settings) -> ScenarioResult:
    result = ScenarioResult(SCENARIO, data={"targets": data, "settings": settings.__dict__})
    lost = sum(int(row["c64_failed"]) for row in data.values())
    if lost:
        result.status, result.reason = "failed", f"{lost} requests failed at c=64"
    direct = data["direct"]
    for name, label in LABELS.items():
        row = data[name]
        added = row["p50_ms"] - direct["p50_ms"]
        share = ratio(row["c64_rps"], direct["c64_rps"])
        result.rows += [
            Row(SCENARIO, f"added p50 at c=1, {label}", "ms", added, direct["p50_ms"],
                target=f"<= {ADDED_P50_TARGET_MS:g} ms", met=added <= ADDED_P50_TARGET_MS),
            Row(SCENARIO, f"throughput at c=64, {label}", "req/s", row["c64_rps"],
                direct["c64_rps"], ratio=share, ratio_of="/direct",
                target=f">= {THROUGHPUT_TARGET:g}x direct",
                met=share is not None and share >= THROUGHPUT_TARGET),
            Row(SCENARIO, f"CPU per request at c=64, {label}", "us", row[f"cpu_us_{name}"],
                direct["cpu_us_client"] + direct["cpu_us_fake"]),
        ]  # fmt: skip
    return result
