"""The ``cli`` provider type: a local program that reads a prompt and writes its answer.

Each run starts the configured argv (never through a shell) in its own process
group, so a cancel or a deadline can stop the program *and* whatever it spawned.
Standard output is the answer and streams as it arrives; standard error is kept
only as a short tail for the failure message.

Settings:

* ``command``: the argv list; ``{model}`` in any argument becomes the run's target.
* ``prompt_via``: ``"stdin"`` (default; the prompt plus a final newline, then EOF)
  or ``"argument"`` (the prompt replaces a ``{prompt}`` placeholder, or is
  appended as the last argument).
* ``kill_grace_ms``: how long a program may take to exit after SIGTERM before
  its process group gets SIGKILL (default 2000).

The prompt of a chat request is the whole conversation rendered as one
``role: content`` line per message (a multi-line content keeps its line breaks),
so system prompts and earlier turns reach the program too; a completions request
sends its ``prompt`` as is. Programs report no usage, so tokens are approximated
by whitespace-separated words of the prompt and of the output.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import os
import re
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from iop_node.domain.health import ProbeResult
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, ExecutionSpec, Operation, Usage
from iop_node.errors import (
    AnswerTooLarge,
    ConfigError,
    InvalidRequest,
    ProviderFailed,
    ProviderUnavailable,
)
from iop_node.ports import AdapterContext, EventSink, LifecycleFlags

READ_CHUNK = 4096
OUTPUT_LENGTH_FIELDS: Final[tuple[str, ...]] = ()
"""None: a program is given only the prompt, and its output is bounded by the run's
deadline (and, not streamed, by the answer limit)."""
STDERR_TAIL_BYTES = 2048
DEFAULT_KILL_GRACE_MS = 2000
DISCARD_TIMEOUT_S = 5.0
PROMPT_VIA = ("stdin", "argument")
_PLACEHOLDER = re.compile(r"\{(model|prompt)\}")


class CliAdapter:
    """Runs one local command per request and streams its standard output."""

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        self._config = config
        self._context = context
        command = config.setting("command")
        if (
            not isinstance(command, Sequence)
            or isinstance(command, str)
            or not command
            or not all(isinstance(arg, str) for arg in command)
            or not command[0]
        ):
            raise ConfigError(f"provider {config.id}: command must be a non-empty list of strings")
        self._command: tuple[str, ...] = tuple(command)
        self._prompt_via = config.setting("prompt_via", "stdin")
        if self._prompt_via not in PROMPT_VIA:
            raise ConfigError(f"provider {config.id}: prompt_via must be stdin or argument")
        grace = config.setting("kill_grace_ms", DEFAULT_KILL_GRACE_MS)
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
            raise ConfigError(f"provider {config.id}: kill_grace_ms must be a non-negative number")
        self._kill_grace = grace / 1000
        # Programs still running, so aclose() can stop them if their runs never finish.
        self._running: set[asyncio.subprocess.Process] = set()

    @property
    def name(self) -> str:
        return "cli"

    def capabilities(self) -> LifecycleFlags:
        return LifecycleFlags()

    async def probe(self) -> ProbeResult:
        """Only checks that the executable resolves: running it could cost a completion."""
        executable = self._command[0]
        if shutil.which(executable) is None:
            return ProbeResult(ok=False, detail=f"executable not found: {executable}")
        return ProbeResult(ok=True, models=self._config.models)

    async def aclose(self) -> None:
        """Stop every program still running (their runs then fail or finish on EOF)."""
        await asyncio.gather(*(self._terminate(proc) for proc in list(self._running)))

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        if spec.operation is Operation.EMBEDDINGS:
            raise InvalidRequest("cli providers do not serve embeddings")
        prompt = _prompt(spec)
        argv = self._argv(spec.target, prompt)
        stdin = (prompt + "\n").encode() if self._prompt_via == "stdin" else None
        output = await self._run(spec, argv, stdin, sink)
        usage = Usage.of(len(prompt.split()), len(output.split()))
        if spec.stream:
            return Completion(finish_reason="stop", usage=usage)
        return Completion(finish_reason="stop", usage=usage, result=_body(spec, output, usage))

    def _argv(self, target: str, prompt: str) -> list[str]:
        """Fills the placeholders in one pass, so a prompt containing ``{model}`` stays intact."""
        values = {"model": target, "prompt": prompt}
        via_argument = self._prompt_via == "argument"

        def fill(match: re.Match[str]) -> str:
            key = match.group(1)
            return values[key] if key == "model" or via_argument else match.group(0)

        argv = [_PLACEHOLDER.sub(fill, arg) for arg in self._command]
        if via_argument and not any("{prompt}" in arg for arg in self._command):
            argv.append(prompt)
        return argv

    async def _run(
        self, spec: ExecutionSpec, argv: list[str], stdin: bytes | None, sink: EventSink
    ) -> str:
        """Runs the program to its end and returns its output; stops it on any way out."""
        proc = await self._spawn(argv, stdin is not None)
        self._running.add(proc)
        stderr_tail = bytearray()
        helpers: list[asyncio.Task[None]] = []
        try:
            if stdin is not None:
                helpers.append(asyncio.create_task(_feed(proc, stdin)))
            helpers.append(asyncio.create_task(_keep_tail(proc, stderr_tail)))
            output = await _stream(proc, spec, sink, self._context.max_answer_bytes)
            returncode = await proc.wait()
            await asyncio.gather(*helpers)
        except BaseException:
            await self._terminate(proc)
            raise
        finally:
            self._running.discard(proc)
            for task in helpers:
                task.cancel()
            # Reaping the helpers keeps their errors from going unretrieved; their
            # pipes are closed by now, so this is quick.
            await asyncio.gather(*helpers, return_exceptions=True)
        if returncode != 0:
            tail = stderr_tail.decode(errors="replace").strip()
            how = (
                f"was killed by signal {signal.Signals(-returncode).name}"
                if returncode < 0 and -returncode in signal.valid_signals()
                else f"exited with code {returncode}"
            )
            raise ProviderFailed(f"{argv[0]} {how}: {tail}")
        if spec.stream and spec.operation is Operation.CHAT_COMPLETIONS and not output:
            await sink.delta(Delta(role="assistant"))  # the client still learns who spoke
        return output

    async def _spawn(self, argv: list[str], with_stdin: bool) -> asyncio.subprocess.Process:
        try:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                raise InvalidRequest(
                    "prompt too long to pass as an argument (use prompt_via: stdin)"
                ) from exc
            raise ProviderUnavailable(f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
        except ValueError as exc:  # a NUL byte in an argument
            raise InvalidRequest(f"cannot pass the prompt as an argument: {exc}") from exc

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period, reap the leader.

        SIGKILL goes out even when the leader obeyed SIGTERM, because a grandchild
        may have ignored it. The group id stays reserved while any member lives,
        so this cannot hit a stranger unless the group emptied and the id was
        reused within the grace period: a window small enough to accept.
        """
        _signal_group(proc, signal.SIGTERM)
        try:
            async with asyncio.timeout(self._kill_grace):
                await proc.wait()
        except TimeoutError:
            pass
        finally:
            _signal_group(proc, signal.SIGKILL)
        await proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        await _discard_output(proc)


async def _discard_output(proc: asyncio.subprocess.Process) -> None:
    """Reads what is left of a stopped program's stdout to its end, and drops it.

    A run that stopped reading early (its answer over the limit, its client gone) leaves
    the pipe paused with a full buffer: it would never see its end and never close. The
    group is dead, so the end comes after at most a pipe's worth of bytes; the bound is
    for a descendant that left the group with the pipe open.
    """
    assert proc.stdout is not None
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(DISCARD_TIMEOUT_S):
            while await proc.stdout.read(READ_CHUNK):
                pass


def _signal_group(proc: asyncio.subprocess.Process, signum: signal.Signals) -> None:
    # The group may be gone already (or, were its id reused, belong to someone else).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    """Writes the prompt and closes stdin; a program that exits without reading is fine."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
        await proc.stdin.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        proc.stdin.close()


async def _keep_tail(proc: asyncio.subprocess.Process, tail: bytearray) -> None:
    """Drains stderr concurrently (a full pipe would stall the program), keeping its end."""
    assert proc.stderr is not None
    while chunk := await proc.stderr.read(READ_CHUNK):
        tail += chunk
        del tail[:-STDERR_TAIL_BYTES]


async def _stream(
    proc: asyncio.subprocess.Process, spec: ExecutionSpec, sink: EventSink, limit: int
) -> str:
    """Reads stdout to EOF, sending each decoded chunk on as a delta when streaming.

    The incremental decoder holds back the first bytes of a character split
    across two reads; undecodable bytes become U+FFFD rather than failing the run.
    A non-streamed answer goes to the edge in one frame: past ``limit`` bytes of
    output the run fails (``AnswerTooLarge``) and the program is stopped.
    """
    assert proc.stdout is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    role = "assistant" if spec.operation is Operation.CHAT_COMPLETIONS else ""
    pieces: list[str] = []
    final = False
    size = 0
    while not final:
        chunk = await proc.stdout.read(READ_CHUNK)
        final = not chunk
        size += len(chunk)
        if size > limit and not spec.stream:
            raise AnswerTooLarge(limit)
        text = decoder.decode(chunk, final=final)
        if not text:
            continue
        pieces.append(text)
        if spec.stream:
            await sink.delta(Delta(text=text, role=role))
            role = ""
    return "".join(pieces)


def _prompt(spec: ExecutionSpec) -> str:
    body = spec.body
    if spec.operation is Operation.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequest("messages must be a list of objects")
        return "\n".join(f"{m.get('role', 'user')}: {_text(m.get('content'))}" for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("cli providers take one prompt string")
    return prompt


def _text(content: Any) -> str:
    """The text of a message content: a string, or the text parts of a parts list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    raise InvalidRequest("message content must be a string or a list of parts")


def _body(spec: ExecutionSpec, output: str, usage: Usage) -> dict[str, Any]:
    """The OpenAI non-streaming response body for the collected output."""
    if spec.operation is Operation.CHAT_COMPLETIONS:
        object_, id_ = "chat.completion", f"chatcmpl-{spec.run_id}"
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": output},
            "logprobs": None,
            "finish_reason": "stop",
        }
    else:
        object_, id_ = "text_completion", f"cmpl-{spec.run_id}"
        choice = {"index": 0, "text": output, "logprobs": None, "finish_reason": "stop"}
    return {
        "id": id_,
        "object": object_,
        "created": int(time.time()),
        "model": spec.target,
        "choices": [choice],
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        },
    }
