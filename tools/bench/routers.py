"""The Rust routers people deploy in front of vLLM and SGLang, measured in the same run.

``make bench-peers`` installs ``vllm-router`` and ``sglang-router`` from the package
index (wheels with the Rust binary inside), each into a venv of its own under
``tools/bench/.peers/``. Without one, the benchmark still runs and says so in its
column.

Both run as the benchmark runs IOP and LiteLLM: the one fake backend as their only
worker, round robin (with one worker every policy picks it; this one does the least
work per request), no authentication, warnings only in the log (no per-request
line), everything on 127.0.0.1: the router's own port and its Prometheus port,
which sglang-router would otherwise bind on every interface, and both would bind
to the same default port (29000).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

from iop_proto.testing import port_taken, ports_to_try

from .peers import PEERS_DIR
from .procs import Gateway, spawn

READY_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class RouterKind:
    """One router: its column, its pinned release, how it is started."""

    name: str  # the column and the JSON key: vllm_router | sglang_router
    package: str
    version: str  # the one `make bench-peers` installs (the Makefile pins the same)
    command: tuple[str, ...]  # below the venv's bin/
    log_level: str

    @property
    def venv(self) -> Path:
        return PEERS_DIR / self.name

    @property
    def binary(self) -> Path:
        return self.venv / "bin" / self.command[0]

    def available(self) -> bool:
        return self.binary.is_file()

    def installed_version(self) -> str | None:
        """The version in the venv's metadata (no import), or ``None``."""
        wheel = self.package.replace("-", "_")
        found = sorted(self.venv.glob(f"lib/python*/site-packages/{wheel}-*.dist-info"))
        if not found:
            return None
        return found[-1].name.removeprefix(f"{wheel}-").removesuffix(".dist-info")

    def missing(self) -> str:
        return "not installed (make bench-peers)"


VLLM_ROUTER: Final = RouterKind(
    "vllm_router", "vllm-router", "0.1.17", ("vllm-router",), log_level="warning"
)
SGLANG_ROUTER: Final = RouterKind(
    "sglang_router", "sglang-router", "0.3.2", ("sglang-router", "launch"), log_level="warn"
)
ROUTERS: Final = (VLLM_ROUTER, SGLANG_ROUTER)
# smg (Shepherd Model Gateway, sglang-router's successor) runs in the agents scenario only:
# its generic HTTP mode in front of llama.cpp engines.
SMG: Final = RouterKind("smg", "smg", "1.13.0", ("smg", "launch"), log_level="warn")


@dataclass(frozen=True)
class Router:
    kind: RouterKind
    base_url: str  # ends in /v1
    pid: int

    def gateway(self) -> Gateway:
        return Gateway(self.kind.name, {self.kind.name: self.pid})


async def _wait_routing(url: str, model: str, timeout_s: float) -> None:
    """Until a chat completion through the router succeeds: both start their HTTP
    server before their worker is healthy (sglang-router adds it in the background)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        async with asyncio.timeout(timeout_s):
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def start_router(
    kind: RouterKind,
    root: Path,
    backend_url: str | Sequence[str],
    model: str,
    *,
    policy: str = "round_robin",
    extra: Sequence[str] = (),
) -> AsyncIterator[Router]:
    """``kind`` routing to the worker(s) at ``backend_url`` with ``policy``, ready to serve
    ``model``; ``extra``: more of its command-line arguments."""
    workers = [backend_url] if isinstance(backend_url, str) else list(backend_url)
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        # Neither can bind port 0 and report it: two ports, again if one was taken.
        ports = ports_to_try(10)
        for port in ports:
            metrics_port = next(ports)
            argv = [
                str(kind.binary),
                *kind.command[1:],
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--worker-urls", *workers, "--policy", policy),
                *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
                *("--log-level", kind.log_level),
                *extra,
            ]
            attempt = contextlib.AsyncExitStack()
            url = f"http://127.0.0.1:{port}"
            try:
                child = await attempt.enter_async_context(
                    spawn(argv, ready=None, log=root / f"{kind.name}-{policy}.log")
                )
                await _wait_routing(url, model, READY_TIMEOUT_S)
            except BaseException as exc:
                await attempt.aclose()
                if isinstance(exc, TimeoutError) and (port_taken(port) or port_taken(metrics_port)):
                    continue  # another process bound a port first
                raise
            stack.push_async_callback(attempt.aclose)
            break
        else:
            raise RuntimeError(f"{kind.name}: no free pair of ports")
        yield Router(kind, f"{url}/v1", child.pid)
