"""The README's newcomer path, run from its own blocks (tests/readme_blocks.py says how).

``make run`` as the README shows it (on moved ports, state in a temporary directory), then
each block in order in one shell's environment: ``.venv/bin`` on PATH, a first request, a
key issued into the running stack's store and used by the OpenAI SDK, the key listed; the
agents' blocks where Codex CLI or Claude Code is installed (``make agents``), skipped with
the reason where not. ``make test`` is only resolved (``make -n``): it runs for minutes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from readme_blocks import (
    README,
    ROOT,
    Block,
    blocks,
    find_program,
    newcomer_env,
    run_block,
    with_stack_state,
)

from iop_proto.testing import port_offsets, port_taken

UP_TIMEOUT_S = 240.0  # the first make run on a busy 2-core machine
STOP_TIMEOUT_S = 30.0
BLOCK_TIMEOUT_S = 120.0
STEPS = ["run", "test", "path", "first", "key", "key", "sdk", "codex", "claude"]


def _devstack_ports() -> list[int]:
    spec = importlib.util.spec_from_file_location("iop_readme_devstack", ROOT / "tools/devstack.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [port for s in module.SERVICES for port in s.all_ports().values()]


@dataclass
class Stack:
    """``make run`` started from the README's block; owns its process group."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    up: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if "IOP is up" in line:
                self.up.set()

    def wait_up(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.up.wait(1.0):
                return True
            if self.process.poll() is not None:
                return self.up.is_set()
        return False

    def stop(self) -> None:
        """Ctrl-C, as in the terminal it runs in: the whole foreground group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@contextlib.contextmanager
def make_run(block: Block, env: dict[str, str]) -> Iterator[Stack]:
    process = subprocess.Popen(
        ["bash", "-c", block.body],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    stack = Stack(process)
    reader = threading.Thread(target=stack.read, daemon=True)
    reader.start()
    try:
        yield stack
    finally:
        stack.stop()
        reader.join(STOP_TIMEOUT_S)
        assert process.stdout is not None
        process.stdout.close()


@dataclass
class Newcomer:
    """The shell the README's blocks ran in, and what each printed."""

    env: dict[str, str]
    offset: int
    outputs: dict[str, list[str]] = field(default_factory=dict)

    def run(self, block: Block) -> str:
        ran = run_block(block, self.env, self.offset, BLOCK_TIMEOUT_S)
        assert ran.returncode == 0, f"README block {block.step!r} failed:\n{ran.output}"
        self.outputs.setdefault(block.step, []).append(ran.output)
        return ran.output


def test_every_block_of_the_readme_is_marked_and_in_order() -> None:
    text = README.read_text()
    fences = [line for line in text.splitlines() if line.startswith(("```sh", "```python"))]
    found = blocks()
    assert len(fences) == len(found)  # a runnable block without a mark fails here
    assert [block.step for block in found] == STEPS
    assert [block.step for block in found if block.mode == "background"] == ["run"]


def test_make_test_as_the_readme_spells_it_resolves() -> None:
    (block,) = [block for block in blocks() if block.mode == "dry"]
    command = block.body.split("#")[0].split()
    assert command == ["make", "test"]
    done = subprocess.run(
        ["make", "-n", *command[1:]], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "-m pytest" in done.stdout


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Newcomer]:
    run_block_, *rest = (block for block in blocks() if block.mode != "dry")
    assert run_block_.step == "run"
    ports = _devstack_ports()
    for offset in port_offsets(ports):
        base = tmp_path_factory.mktemp("newcomer")
        (base / "home").mkdir()
        env = newcomer_env(base / "state", base / "home", offset)
        with make_run(run_block_, env) as stack:
            if not stack.wait_up(UP_TIMEOUT_S):
                stack.stop()
                if any(port_taken(port + offset) for port in ports):
                    continue  # lost a port to another process meanwhile: the next offset
                pytest.fail(f"make run was not up in {UP_TIMEOUT_S:.0f} s:\n{stack.output}")
            with_stack_state(env, base / "state")
            person = Newcomer(env, offset)
            for block in rest:
                if block.needs is None:
                    person.run(block)
            yield person
            return
    pytest.fail("no free block of ports for make run")


@pytest.mark.timeout(UP_TIMEOUT_S + 4 * BLOCK_TIMEOUT_S)
def test_the_newcomer_path_runs_as_written(newcomer: Newcomer) -> None:
    assert newcomer.env["PATH"].split(":")[0] == str(ROOT / ".venv" / "bin")
    (first,) = newcomer.outputs["first"]
    assert '"object":"chat.completion"' in first.replace(" ", "")
    _issued, listed = newcomer.outputs["key"]
    assert newcomer.env["OPENAI_API_KEY"].startswith("sk-iop-")
    assert "app" in listed
    (sdk,) = newcomer.outputs["sdk"]
    assert sdk.strip(), "the SDK's stream printed nothing"


@pytest.mark.timeout(2 * BLOCK_TIMEOUT_S)
@pytest.mark.parametrize("program", ["codex", "claude"])
def test_an_agent_as_the_readme_points_it(newcomer: Newcomer, program: str) -> None:
    (block,) = [block for block in blocks() if block.needs == program]
    found = find_program(program, newcomer.env)
    if found is None:
        why = f"{program} is not installed (make agents installs it into var/agents)"
        if os.environ.get("TEST_AGENTS_REQUIRED") == "1":
            pytest.fail(f"TEST_AGENTS_REQUIRED is set but {why}", pytrace=False)
        pytest.skip(why)
    env = dict(newcomer.env, PATH=f"{Path(found).parent}:{newcomer.env['PATH']}")
    ran = run_block(block, env, newcomer.offset, BLOCK_TIMEOUT_S)
    assert ran.returncode == 0, f"{program} failed:\n{ran.output}"
    assert ran.output.strip()
