"""Child processes of the benchmark and what they cost: CPU seconds and peak RSS from /proc.

Gateways are measured from the outside, the way the router projects measure theirs:
``utime + stime`` of every process in the gateway's tree (a server that forks a
worker is still one gateway) and ``VmHWM``, the kernel's own high-water mark of
resident memory, so no sampling can miss a peak.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_NO_LINE = re.compile("").fullmatch("")  # a child started with ready=None matched nothing
assert _NO_LINE is not None
STOP_TIMEOUT_S = 10.0


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may contain spaces)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (one scan of /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, ()))
    return tree


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes so far (children reaped are not counted)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS_PER_S


def _status_kib(pid: int, key: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def peak_rss_mib(pids: Iterable[int]) -> float:
    """The sum of each process's own peak RSS (an upper bound of the tree's peak)."""
    return sum(_status_kib(pid, "VmHWM") for pid in pids) / 1024


def rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmRSS") / 1024


@dataclass(frozen=True)
class Gateway:
    """The processes one gateway runs as, named for the report (edge, node, litellm)."""

    name: str
    roots: dict[str, int]

    def pids(self) -> list[int]:
        return [pid for root in self.roots.values() for pid in descendants(root)]

    def cpu(self) -> float:
        return cpu_seconds(self.pids())

    def peak_rss(self) -> dict[str, float]:
        """Peak RSS (MiB) of each named process tree and their ``total``."""
        parts = {name: peak_rss_mib(descendants(pid)) for name, pid in self.roots.items()}
        return {**parts, "total": sum(parts.values())}


@dataclass
class Child:
    """A child process started by ``spawn``: its pid, the line that said it was ready."""

    process: asyncio.subprocess.Process
    ready_line: str
    match: re.Match[str]

    @property
    def pid(self) -> int:
        return self.process.pid


async def _read_ready(
    stream: asyncio.StreamReader, ready: re.Pattern[str], log: Path
) -> tuple[str, re.Match[str]]:
    with log.open("a") as sink:
        while raw := await stream.readline():
            line = raw.decode(errors="replace")
            sink.write(line)
            match = ready.search(line)
            if match:
                return line, match
    raise RuntimeError(f"exited before printing a line matching {ready.pattern!r}:\n{_tail(log)}")


def _tail(log: Path, limit: int = 3000) -> str:
    """The end of a child's log, for an error message that outlives its scratch folder."""
    text = log.read_text(errors="replace")
    return text if len(text) <= limit else "..." + text[-limit:]


async def _drain(stream: asyncio.StreamReader, log: Path) -> None:
    """Keep reading the child's output so it never blocks on a full pipe."""
    with log.open("a") as sink:
        while raw := await stream.readline():
            sink.write(raw.decode(errors="replace"))


@contextlib.asynccontextmanager
async def spawn(
    argv: Sequence[str],
    *,
    ready: re.Pattern[str] | None,
    log: Path,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    stdin_pipe: bool = False,
) -> AsyncIterator[Child]:
    """Start ``argv`` and wait for an output line matching ``ready`` (the readiness signal;
    ``None``: no line to wait for, the caller polls the child itself).

    stdout and stderr are merged into ``log``. On exit the process gets SIGTERM (or,
    with ``stdin_pipe``, first its stdin closed: how a child serving "until stdin
    closes" is asked to stop), then SIGKILL after ``STOP_TIMEOUT_S``: a benchmark
    never leaves a process behind.
    """
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    drain: asyncio.Task[None] | None = None
    try:
        line, match = "", _NO_LINE
        try:
            if ready is not None:
                line, match = await asyncio.wait_for(
                    _read_ready(process.stdout, ready, log), timeout_s
                )
        except TimeoutError:
            raise RuntimeError(
                f"{argv[0]} not ready within {timeout_s:g} s:\n{_tail(log)}"
            ) from None
        drain = asyncio.create_task(_drain(process.stdout, log), name=f"drain:{argv[0]}")
        yield Child(process=process, ready_line=line, match=match)
    finally:
        await stop(process)
        if drain is not None:
            await drain


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM, a bounded wait, then SIGKILL; the whole process group is not touched."""
    if process.stdin is not None and process.returncode is None:
        process.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
