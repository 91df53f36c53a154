"""The suite itself under the conditions a new user's machine may impose.

``make test`` started from a shell that ignores SIGINT (a background job, ``nohup``, some CI
runners) hands that disposition to every process it starts: a test that needs Ctrl-C to
reach a child must set it for the child itself. Run here as such a shell would, in a pytest
of its own, so the disposition is the one under test whatever this run's own is.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CTRL_C_TESTS = "services/edge/tests/unit/test_iopctl.py"


def _ignore_sigint() -> None:
    """In the child before exec: what ``nohup`` or ``cmd &`` in a script leaves it with."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def test_the_ctrl_c_tests_pass_when_sigint_is_ignored_by_whoever_started_the_run() -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        CTRL_C_TESTS,
        "-k",
        "ctrl_c",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=_ignore_sigint,
    )
    output, _ = await child.communicate()
    text = output.decode()
    assert child.returncode == 0, text[-3000:]
    assert "2 passed" in text, text[-3000:]
