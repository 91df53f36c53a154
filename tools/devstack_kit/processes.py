"""One child of the stack: started in its own session, its output prefixed, its restarts spaced."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .plan import REPO, Plan

SELF = "devstack"
RESTART_FIRST_S = 0.5  # delay before restarting a service that exited
RESTART_MAX_S = 10.0  # the longest delay, however often it exits
RESTART_STABLE_S = 30.0  # up this long, its next exit starts again from RESTART_FIRST_S
LINE_LIMIT = 1 << 20
# What a service logs once it serves: iop_proto.service.runner's "ready: edge admin
# http://..." for the IOP services, tools/llama_server.py's "ready: llamacpp http://...",
# tools/postgres_server.py's "ready: postgres postgresql://...".
READY_LINE = re.compile(r"\bready: \S+ (?:admin )?(?:http|postgresql)://\S+")
COLORS = ("36", "33", "32", "35", "34", "91", "92", "93", "94", "95")


class Console:
    """Writes every line of the stack to our stdout, each prefixed with whose it is."""

    def __init__(self, names: Sequence[str], *, color: bool) -> None:
        self.width = max(len(n) for n in (*names, SELF))
        codes = {name: COLORS[i % len(COLORS)] for i, name in enumerate(names)}
        self.colors = codes if color else {}

    def line(self, name: str, text: str) -> None:
        prefix = f"{name:<{self.width}} |"
        if name in self.colors:
            prefix = f"\033[{self.colors[name]}m{prefix}\033[0m"
        self.write(f"{prefix} {text}")

    def say(self, text: str) -> None:
        self.line(SELF, text)

    def error(self, text: str) -> None:
        print(f"{SELF}: error: {text}", file=sys.stderr, flush=True)

    @staticmethod
    def write(text: str) -> None:
        with contextlib.suppress(BrokenPipeError):  # `make run | head` is no reason to crash
            print(text, flush=True)


def wants_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


async def pump_output(
    stream: asyncio.StreamReader, name: str, console: Console, ready: asyncio.Event
) -> None:
    """Copy a child's merged stdout/stderr line by line, and notice its ``ready:`` line."""
    while True:
        try:
            raw = await stream.readline()
        except ValueError:  # longer than LINE_LIMIT; asyncio has already dropped it
            console.line(name, f"[devstack: dropped a line longer than {LINE_LIMIT} bytes]")
            continue
        if not raw:
            return
        text = raw.decode(errors="replace").rstrip("\r\n")
        console.line(name, text)
        if READY_LINE.search(text):
            ready.set()


# --- children ----------------------------------------------------------------------------


@dataclass(eq=False)
class Child:
    """A started service: its process, and the tasks that follow its output and its exit."""

    plan: Plan
    proc: asyncio.subprocess.Process
    exited: asyncio.Task[int]
    pump: asyncio.Task[None]
    ready: asyncio.Event
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Backoff:
    """The delay before each restart of one service.

    It doubles up to ``max_s`` while the service keeps exiting soon after it started,
    so one that cannot run does not spin the machine, and falls back to ``first_s``
    once the service had stayed up ``stable_s``: one crash a day is restarted at once.
    """

    first_s: float = RESTART_FIRST_S
    max_s: float = RESTART_MAX_S
    stable_s: float = RESTART_STABLE_S
    _next_s: float | None = field(default=None, init=False, repr=False)

    def after(self, uptime_s: float) -> float:
        """The delay before the next start of a service that ran ``uptime_s`` seconds."""
        if self._next_s is None or uptime_s >= self.stable_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay


def signal_group(pgid: int, signum: signal.Signals) -> None:
    """Signal a child's whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def write_pid_file(path: Path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")


async def spawn(plan: Plan, console: Console) -> Child:
    """Start one service in its own session, so only we decide when it gets a signal."""
    proc = await asyncio.create_subprocess_exec(
        *plan.argv,
        cwd=REPO,
        env=dict(plan.env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        limit=LINE_LIMIT,
    )
    ready = asyncio.Event()
    assert proc.stdout is not None
    pump = asyncio.create_task(pump_output(proc.stdout, plan.name, console, ready))
    return Child(plan, proc, asyncio.create_task(proc.wait()), pump, ready)
