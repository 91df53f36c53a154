"""The cli adapter against real programs: small Python scripts written into ``tmp_path``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from iop_node.adapters.cli import CliAdapter
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Delta, ExecutionSpec, Operation, Usage
from iop_node.errors import (
    AnswerTooLarge,
    ConfigError,
    InvalidRequest,
    ProviderFailed,
    ProviderTimeout,
    ProviderUnavailable,
)
from iop_node.ports import AdapterContext, LifecycleFlags
from iop_node.testing import execute_as_node
from iop_proto import json_codec

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}

# Waits (bounded) for a file the test creates, so a script can pause until the
# adapter has provably passed on what it wrote so far.
WAIT_FOR = """
import os, sys, time
def wait_for(path):
    give_up = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > give_up:
            sys.exit(99)
        time.sleep(0.01)
"""


class Collect:
    """An event sink that keeps every delta and calls a hook after each one."""

    def __init__(self, on_delta: Callable[[Collect], None] | None = None) -> None:
        self.deltas: list[Delta] = []
        self.changed = asyncio.Event()
        self._on_delta = on_delta

    async def delta(self, delta: Delta) -> None:
        self.deltas.append(delta)
        self.changed.set()
        if self._on_delta is not None:
            self._on_delta(self)

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    async def wait_for_lines(self, count: int) -> list[str]:
        while self.text.count("\n") < count:
            self.changed.clear()
            await self.changed.wait()
        return self.text.splitlines()


@pytest.fixture
async def context() -> AsyncIterator[AdapterContext]:
    async with aiohttp.ClientSession() as http:
        yield AdapterContext(http=http, environ={})


def script(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(WAIT_FOR + textwrap.dedent(source))
    return str(path)


def cli(context: AdapterContext, command: list[str], **settings: Any) -> CliAdapter:
    settings.setdefault("kill_grace_ms", 300)
    config = ProviderConfig(
        id="c1", type="cli", models=("tiny",), settings={"command": command, **settings}
    )
    return CliAdapter(config, context)


def spec(
    body: dict[str, Any],
    *,
    operation: Operation = Operation.CHAT_COMPLETIONS,
    stream: bool = True,
    timeout: float = 30.0,
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="r1",
        model="tiny",
        provider_id="c1",
        adapter="cli",
        target="tiny-target",
        operation=operation,
        body_json=json_codec.dumps({"model": "tiny-target", **body}),
        stream=stream,
        include_usage=True,
        deadline=asyncio.get_running_loop().time() + timeout,
    )


def exited(pid: int) -> bool:
    """True once ``pid`` has exited; a zombie nobody has reaped yet counts as exited."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def gone(pid: int) -> bool:
    """Polls ``exited`` briefly: a SIGKILLed grandchild dies a moment after the signal."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 5
    while not exited(pid):
        if loop.time() > give_up:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_deltas_arrive_while_the_program_runs(
    context: AdapterContext, tmp_path: Path
) -> None:
    marker = tmp_path / "seen-first"
    program = script(
        tmp_path,
        "stream.py",
        """
        print("first", flush=True)
        wait_for(sys.argv[1])
        for word in ("second", "third"):
            print(word, flush=True)
            time.sleep(0.01)
        """,
    )
    # The program only goes on once the first delta reached the sink: a buffered
    # adapter would leave it waiting until it gives up with exit code 99.
    sink = Collect(on_delta=lambda _: marker.touch())
    adapter = cli(context, [sys.executable, program, str(marker)])
    completion = await adapter.execute(spec(CHAT), sink)

    assert sink.text == "first\nsecond\nthird\n"
    assert sink.deltas[0].role == "assistant"
    assert all(d.role == "" for d in sink.deltas[1:])
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage.of(5, 3)
    assert completion.result is None


async def test_prompt_via_stdin_is_the_rendered_conversation(
    context: AdapterContext, tmp_path: Path
) -> None:
    program = script(tmp_path, "echo.py", "sys.stdout.write('got:' + sys.stdin.read())")
    adapter = cli(context, [sys.executable, program])
    completion = await adapter.execute(spec(CHAT, stream=False), Collect())
    assert completion.result is not None
    message = completion.result["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "got:system: be brief\nuser: hi\n"}


async def test_prompt_replaces_the_placeholder_argument(
    context: AdapterContext, tmp_path: Path
) -> None:
    program = script(tmp_path, "args.py", "import json; print(json.dumps(sys.argv[1:]))")
    adapter = cli(
        context,
        [sys.executable, program, "--model={model}", "{prompt}", "--last"],
        prompt_via="argument",
    )
    body = {"prompt": "say {model} literally"}
    completion = await adapter.execute(
        spec(body, operation=Operation.COMPLETIONS, stream=False), Collect()
    )
    assert completion.result is not None
    text = completion.result["choices"][0]["text"]
    assert text == '["--model=tiny-target", "say {model} literally", "--last"]\n'
    assert completion.result["object"] == "text_completion"
    assert completion.result["model"] == "tiny-target"


async def test_prompt_is_appended_without_a_placeholder(
    context: AdapterContext, tmp_path: Path
) -> None:
    program = script(tmp_path, "args.py", "import json; print(json.dumps(sys.argv[1:]))")
    adapter = cli(context, [sys.executable, program, "-m", "{model}"], prompt_via="argument")
    sink = Collect()
    await adapter.execute(spec({"prompt": ["one prompt"]}, operation=Operation.COMPLETIONS), sink)
    assert sink.text == '["-m", "tiny-target", "one prompt"]\n'
    assert sink.deltas[0].role == ""


async def test_non_zero_exit_reports_the_stderr_tail(
    context: AdapterContext, tmp_path: Path
) -> None:
    # 200 KiB of stderr: more than a pipe holds, so an adapter that did not
    # drain it concurrently would deadlock here.
    program = script(
        tmp_path,
        "fail.py",
        """
        sys.stderr.write("noise " * 35_000)
        sys.stderr.write("\\nboom: the real reason\\n")
        sys.exit(7)
        """,
    )
    with pytest.raises(ProviderFailed) as caught:
        await cli(context, [sys.executable, program]).execute(spec(CHAT), Collect())
    message = caught.value.message
    assert "exited with code 7" in message
    assert message.endswith("boom: the real reason")
    assert len(message) < 2500


async def test_cancel_kills_the_whole_process_group(
    context: AdapterContext, tmp_path: Path
) -> None:
    program = script(
        tmp_path,
        "stubborn.py",
        """
        import signal, subprocess
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        print(os.getpid(), child.pid, flush=True)
        time.sleep(1000)
        """,
    )
    sink = Collect()
    run = asyncio.create_task(cli(context, [sys.executable, program]).execute(spec(CHAT), sink))
    leader, grandchild = map(int, (await sink.wait_for_lines(1))[0].split())
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert await gone(leader)
    assert await gone(grandchild)


async def test_deadline_is_a_provider_timeout_and_stops_the_program(
    context: AdapterContext, tmp_path: Path
) -> None:
    program = script(tmp_path, "sleepy.py", "print(os.getpid(), flush=True); time.sleep(1000)")
    sink = Collect()
    with pytest.raises(ProviderTimeout):
        await execute_as_node(
            cli(context, [sys.executable, program]), spec(CHAT, timeout=1.0), sink
        )
    assert await gone(int(sink.text))


async def test_utf8_split_across_reads_stays_intact(
    context: AdapterContext, tmp_path: Path
) -> None:
    marker = tmp_path / "seen-first"
    program = script(
        tmp_path,
        "utf8.py",
        """
        data = "café ☕ ok".encode()
        cut = data.index(b"\\xc3") + 1  # between the two bytes of é
        sys.stdout.buffer.write(data[:cut])
        sys.stdout.buffer.flush()
        wait_for(sys.argv[1])
        sys.stdout.buffer.write(data[cut:])
        sys.stdout.buffer.flush()
        """,
    )
    sink = Collect(on_delta=lambda _: marker.touch())
    await cli(context, [sys.executable, program, str(marker)]).execute(spec(CHAT), sink)
    assert sink.deltas[0].text == "caf"
    assert sink.text == "café ☕ ok"


async def test_missing_executable_is_unavailable(context: AdapterContext, tmp_path: Path) -> None:
    for command in ([str(tmp_path / "no-such-program")], ["iop-no-such-program-anywhere"]):
        adapter = cli(context, command)
        with pytest.raises(ProviderUnavailable):
            await adapter.execute(spec(CHAT), Collect())
        result = await adapter.probe()
        assert not result.ok
        assert command[0] in result.detail


async def test_probe_resolves_without_running(context: AdapterContext, tmp_path: Path) -> None:
    witness = tmp_path / "ran"
    program = tmp_path / "tool.sh"
    program.write_text(f"#!/bin/sh\ntouch {witness}\n")
    program.chmod(0o755)
    for command in ([str(program)], ["sh", "-c", "true"]):
        adapter = cli(context, command)
        result = await adapter.probe()
        assert result.ok
        assert result.models == ("tiny",)
        assert adapter.capabilities() == LifecycleFlags()
        assert adapter.name == "cli"
    assert not witness.exists()


async def test_embeddings_are_refused(context: AdapterContext) -> None:
    adapter = cli(context, [sys.executable, "-c", "pass"])
    with pytest.raises(InvalidRequest, match="do not serve embeddings"):
        await adapter.execute(spec({"input": "x"}, operation=Operation.EMBEDDINGS), Collect())


async def test_aclose_stops_running_programs(context: AdapterContext, tmp_path: Path) -> None:
    program = script(tmp_path, "sleepy.py", "print(os.getpid(), flush=True); time.sleep(1000)")
    adapter = cli(context, [sys.executable, program])
    sink = Collect()
    run = asyncio.create_task(adapter.execute(spec(CHAT), sink))
    pid = int((await sink.wait_for_lines(1))[0])
    await adapter.aclose()
    with pytest.raises(ProviderFailed, match="killed by signal SIGTERM"):
        await run
    assert await gone(pid)


async def test_program_that_ignores_stdin_still_succeeds(
    context: AdapterContext, tmp_path: Path
) -> None:
    program = script(tmp_path, "deaf.py", "print('done')")
    huge = {"messages": [{"role": "user", "content": "word " * 100_000}]}
    completion = await cli(context, [sys.executable, program]).execute(spec(huge), Collect())
    assert completion.usage == Usage.of(100_001, 1)


@pytest.mark.parametrize(
    "settings",
    [
        {"command": "python -c pass"},
        {"command": []},
        {"command": ["x"], "prompt_via": "env"},
        {"command": ["x"], "kill_grace_ms": -1},
    ],
)
async def test_bad_settings_are_a_config_error(
    context: AdapterContext, settings: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError):
        CliAdapter(ProviderConfig(id="c1", type="cli", settings=settings), context)


async def test_an_answer_past_the_limit_fails_and_stops_the_program(
    context: AdapterContext, tmp_path: Path
) -> None:
    """Not streamed, the output goes to the edge in one frame: past the node's answer
    limit the run fails as the request's, and the program is stopped, not read on."""
    pid_file = tmp_path / "pid"
    program = script(
        tmp_path,
        "endless.py",
        f"""
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        while True:
            sys.stdout.write("word " * 1000)
        """,
    )
    small = dataclasses.replace(context, max_answer_bytes=64 * 1024)
    with pytest.raises(AnswerTooLarge, match="passed 65536 bytes"):
        await cli(small, [sys.executable, program]).execute(spec(CHAT, stream=False), Collect())
    assert await gone(int(pid_file.read_text()))
