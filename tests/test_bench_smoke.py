"""The benchmark tools run end to end, so that they cannot rot between benchmark runs.

``tools/bench/run.py --tiny`` starts everything the real run starts (the fake
backend, an IOP stack, the real model where installed) with a handful of
requests per scenario: it exits 0 and writes a JSON document with every scenario
in it. ``tools/bench/hops.py`` traces one streamed chat completion in the edge and
the node: its path starts at the edge's chat-completions handler, reaches the
node's adapter, and writes the body's ``model`` at least once. Only behaviour is
checked, no number: timings on a shared CI machine would make this flaky, and
restructuring the edge changes the hop count on purpose.
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
HOPS = REPO / "tools" / "bench" / "hops.py"
SCENARIOS = {
    "overhead", "sweep", "streaming", "floor", "scale", "edges", "realmodel", "vllm", "agents",
}  # fmt: skip
TIMEOUT_S = 115  # the run stops itself after 95 s; this is the backstop
HOPS_TIMEOUT_S = 60  # about 12 s on 2 shared cores

pytestmark = pytest.mark.slow


def run_tool(args: list[str], timeout_s: float, what: str) -> str:
    """Run a bench tool to its end and return its output; fail the test if it hangs
    or exits non-zero.

    A session of its own: if the tool hangs, its whole process group (edge, node,
    fake backend, llama.cpp) goes with it, not just the Python at its top.
    """
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} took over {timeout_s} s:\n{output[-5000:]}")
    assert process.returncode == 0, output[-5000:]
    return output


def test_tiny_run_writes_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    output = run_tool([str(RUN), "--tiny", "--out", str(out)], TIMEOUT_S, "the tiny benchmark run")
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
    # the floor's three variants each served the fake's answers through their hops
    floor = results["scenarios"]["floor"]["data"]["targets"]
    assert set(floor) == {"direct", "design", "libraries", "iop"}
    assert all(row["c64_done"] > 0 and row["c64_failed"] == 0 for row in floor.values())
    # every way through one edge and two served (half the client's workers on each edge,
    # or through a balancer: any failure shows), and the model predicted each way
    edges = results["scenarios"]["edges"]["data"]
    ways = {"1 edge", "1 edge + balancer", "2 edges + balancer", "2 edges, client spreads"}
    for level in edges["sqlite"].values():
        assert set(level) == ways
        assert all(row["done"] > 0 and row["failed"] == 0 for row in level.values())
    assert all(set(fit["predicted_rps"]) == ways for fit in edges["model"].values())


def test_hops_reports_the_path_of_a_stream(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    args = [str(HOPS), "--json", str(out), "--rounds", "2", "--window", "0.5"]
    output = run_tool(args, HOPS_TIMEOUT_S, "the hops tool")
    result = json.loads(out.read_text())
    edge = [(e["module"], e["qualname"]) for e in result["path"]["edge"]]
    node = [(e["module"], e["qualname"]) for e in result["path"]["node"]]
    # the inference pipeline's handler (every API's: InferenceRoutes.route binds it)
    handler = "InferenceRoutes._serve"
    assert any(m == "iop_edge.entrypoints.inference_routes" and q == handler for m, q in edge)
    assert any(m.startswith("iop_node.adapters.") and q.endswith(".execute") for m, q in node)
    assert not any(m.startswith("iop_proto.v1") for m, _ in edge + node)
    assert result["hops"]["total"] == len(edge) + len(node)
    assert result["model_rewrites"], "no function on the path writes the body's model"
    assert "idle window" in result["filter"]
    assert "edge path:" in output
    assert "node path:" in output
    # the edge parses the body (its limits read it) and some function serialises it; the
    # node may pass the edge's bytes through, so nothing is asserted of it
    body = result["body_json"]
    assert body["parsed"]["edge"] >= 1
    assert body["serialised"]["total"] >= 1
    assert all(row["bytes"] >= body["min_bytes"] for row in body["parsed"]["by"])
    assert "body parsed: " in output
    assert "body serialised: " in output


def test_edges_model_takes_no_cap_from_a_process_that_spent_no_measurable_cpu() -> None:
    # a tiny round on a busy machine can leave the fake engine's or the client's CPU
    # under the clock's tick: 0 ms per request bounds nothing, and must not divide
    sys.path.insert(0, str(REPO / "tools"))
    from bench.edges import predict

    costs = {"edge": 1.0, "node": 0.5, "balancer": 0.25, "engine": 0.0, "client": 0.0}
    assert predict(costs, 1, 4, balanced=False) == pytest.approx(1000.0)  # the edge's loop
    assert predict(costs, 3, 4, balanced=False) == pytest.approx(2000.0)  # the node's
    assert predict(costs, 2, 1, balanced=True) == pytest.approx(1000 / 1.75)  # the cores
    nothing = dict.fromkeys(costs, 0.0)
    assert predict(nothing, 1, 4, balanced=True) is None
