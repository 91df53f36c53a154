"""README.md's own shell (and Python) blocks, as the test runs them.

The README marks each block it wants run with a comment just above the fence::

    <!-- readme-test: step=first -->                  run, in the README's order
    <!-- readme-test: step=run run=background -->     a long-running program (make run)
    <!-- readme-test: step=test run=dry (why) -->     resolved with ``make -n``, not run
    <!-- readme-test: step=codex needs=codex -->      run where that program is installed

Blocks run one after the other as in one terminal: what a block exports is in the next
one's environment (``export PATH=...``, ``export IOP_API_KEY=...``). The one thing the test
changes is where the stack listens: it starts ``make run`` on ports moved by one offset
(``PORT_OFFSET``) with its state and pid files in a directory of its own (``DEV_STATE``,
``RUN_DIR``), so the README's
``127.0.0.1:8080`` becomes the moved port, and ``IOP_DATABASE`` points the control-plane's
command at that state (``make key`` gets it from ``DEV_STATE``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
AGENT_BIN = ROOT / "var" / "agents" / "node_modules" / ".bin"  # make agents installs here
_TAG = re.compile(
    r"<!-- readme-test: (?P<tag>[^>]*?)\s*-->\s*\n```(?P<lang>sh|python)\n(?P<body>.*?)\n```",
    re.S,
)
API_PORT = 8080


@dataclass(frozen=True)
class Block:
    step: str
    mode: str  # "run", "background", "dry"
    lang: str  # "sh" or "python"
    body: str
    needs: str | None  # a program the block runs that the README says to install first


def parse(text: str) -> list[Block]:
    blocks = []
    for match in _TAG.finditer(text):
        fields = dict(part.split("=", 1) for part in match["tag"].split() if "=" in part)
        blocks.append(
            Block(
                fields["step"],
                fields.get("run", "run"),
                match["lang"],
                match["body"],
                fields.get("needs"),
            )
        )
    return blocks


def blocks() -> list[Block]:
    return parse(README.read_text())


def moved(text: str, offset: int) -> str:
    """The README's text for a stack whose ports are moved by ``offset``."""
    return text.replace(f"127.0.0.1:{API_PORT}", f"127.0.0.1:{API_PORT + offset}")


def find_program(name: str, env: dict[str, str]) -> str | None:
    """Where ``name`` is: on the block's PATH, or where ``make agents`` installs it."""
    return shutil.which(name, path=env["PATH"]) or shutil.which(name, path=str(AGENT_BIN))


@dataclass(frozen=True)
class Ran:
    returncode: int
    output: str


def run_block(block: Block, env: dict[str, str], offset: int, timeout: float) -> Ran:
    """Run ``block`` as a terminal would, then update ``env`` with what it exported."""
    body = moved(block.body, offset)
    if block.lang == "python":
        python = shutil.which("python", path=env["PATH"]) or "python"
        done = subprocess.run(
            [python, "-c", body],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Ran(done.returncode, done.stdout + done.stderr)
    with tempfile.NamedTemporaryFile("rb", suffix=".env") as exported:
        script = f"set -e -o pipefail\n{body}\nenv -0 > {exported.name}\n"
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,  # an agent reads a prompt from stdin when it is open
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode == 0:
            pairs = (item.split(b"=", 1) for item in exported.read().split(b"\0") if item)
            env.clear()
            env.update({k.decode(): v.decode() for k, v in pairs})
    return Ran(done.returncode, done.stdout + done.stderr)


def newcomer_env(state: Path, home: Path, offset: int) -> dict[str, str]:
    """A newcomer's shell: no ``.venv/bin`` on PATH (the README's own line puts it there)."""
    venv_bin = str(ROOT / ".venv" / "bin")
    path = ":".join(p for p in os.environ.get("PATH", "").split(":") if p and p != venv_bin)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("IOP_", "VIRTUAL_ENV", "PYTEST_", "MAKE"))
    }
    env.update(
        PATH=path or "/usr/bin:/bin",
        HOME=str(home),
        DEV_STATE=str(state),
        RUN_DIR=str(state / "run"),  # beside a developer's own make run of this checkout
        PORT_OFFSET=str(offset),
    )
    return env


def with_stack_state(env: dict[str, str], state: Path) -> None:
    """Once the stack runs: the control-plane's command reads its database (the README's
    ``configs/dev/control-plane.yaml`` names ``var/dev``'s; the test's is ``state``)."""
    env["IOP_DATABASE"] = str(state / "control-plane.db")
