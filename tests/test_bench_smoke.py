"""The benchmark code runs end to end, so that it cannot rot between benchmark runs.

``tools/bench/run.py --tiny`` starts everything the real run starts (the fake
backend, an IOP stack, the real model where installed) with a handful of
requests per scenario. Only behaviour is checked: it exits 0 and writes a JSON
document with every scenario in it. No number is asserted; timings on a shared
CI machine would only make this test flaky.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tools" / "bench" / "run.py"
SCENARIOS = {"overhead", "streaming", "scale", "realmodel"}
TIMEOUT_S = 100  # the run stops itself after 80 s; this is the backstop

pytestmark = pytest.mark.slow


def test_tiny_run_writes_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # A session of its own: if the run hangs, its whole process group (edge, node,
    # fake backend, llama.cpp) goes with it, not just the Python at its top.
    process = subprocess.Popen(
        [sys.executable, str(RUN), "--tiny", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the tiny benchmark run took over {TIMEOUT_S} s:\n{output[-5000:]}")

    assert process.returncode == 0, output[-5000:]
    results = json.loads(out.read_text())
    assert set(results["scenarios"]) == SCENARIOS
    for name, scenario in results["scenarios"].items():
        assert scenario["status"] in {"ok", "skipped"}, (name, scenario["reason"])
        if scenario["status"] == "ok":
            assert scenario["rows"], name
        else:
            assert scenario["reason"], name
    assert results["meta"]["mode"] == "tiny"
    assert {row["scenario"] for row in results["rows"]} <= SCENARIOS
    assert "scenario" in output  # the table was printed
