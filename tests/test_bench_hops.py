"""The hops tool runs end to end, so that the issue's before/after figure stays measurable.

``tools/bench/hops.py`` starts the benchmark's stack, traces one streamed chat
completion in the edge and the node, and reports the IOP functions on its path.
Only behaviour is checked: the path starts at the edge's HTTP handler for chat
completions and reaches the node's adapter; the body's ``model`` is written at least
once on the way. No count is asserted: restructuring the edge changes it on purpose.
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
HOPS = REPO / "tools" / "bench" / "hops.py"
TIMEOUT_S = 60  # about 12 s on 2 shared cores

pytestmark = pytest.mark.slow


def test_hops_reports_the_path_of_a_stream(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    # A session of its own: if the tool hangs, its whole process group goes with it.
    process = subprocess.Popen(
        [sys.executable, str(HOPS), "--json", str(out), "--rounds", "2", "--window", "0.5"],
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
        pytest.fail(f"the hops tool took over {TIMEOUT_S} s:\n{output[-5000:]}")

    assert process.returncode == 0, output[-5000:]
    result = json.loads(out.read_text())
    edge = [(e["module"], e["qualname"]) for e in result["path"]["edge"]]
    node = [(e["module"], e["qualname"]) for e in result["path"]["node"]]
    assert any(m.startswith("iop_edge.") and q.endswith("chat_completions") for m, q in edge)
    assert any(m.startswith("iop_node.adapters.") and q.endswith(".execute") for m, q in node)
    assert not any(m.startswith("iop_proto.v1") for m, _ in edge + node)
    assert result["hops"]["total"] == len(edge) + len(node)
    assert result["model_rewrites"], "no function on the path writes the body's model"
    assert "idle window" in result["filter"]
    assert "edge path:" in output
    assert "node path:" in output
