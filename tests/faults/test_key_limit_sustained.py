"""An API key's ``max_concurrent`` across two edges on one PostgreSQL under sustained load,
and through an edge SIGKILLed and started again
(docs/ARCHITECTURE.md#limits-and-affinity-across-edges).

``tools/hardening/limits_sustained.py`` runs it, every process real: PostgreSQL, a
control-plane, two edges (``key_slot_ttl_s`` 3 s), one node dialling both, the TCP
balancer in front of the edges, and the bench's fake engine, which counts the requests
it answers at once exactly (a time integral). Sixteen clients keep a key limited to 4
busy through the balancer (a 429 is retried), so demand is four times the limit.

What must hold (the issue's "within 10%" of 4 is less than one request):

- the engine never answers more of the key's requests at once than the limit, before,
  during and after the kill;
- the limit is used: the mean at the engine is at least 90% of it while demand exceeds
  it, at the engine and in the store (each request holds the engine for 4 s, so the
  path's own milliseconds, a hundred or two on a busy machine, do not sink the mean);
- the killed edge's slots are freed in the store within its TTL (give or take a renewal
  round and a loaded machine), the engine is back at the limit, and the edge started
  again serves the key under the same limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from iop_proto.testing_postgres import why_postgres_cannot_run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "hardening" / "limits_sustained.py"
LIMIT = 4
TTL_S = 3.0
ARGS = [
    "--limit", str(LIMIT), "--clients", "16", "--hold-ms", "4000", "--steady-s", "24",
    "--ttl", str(TTL_S), "--after-s", "8",
]  # fmt: skip

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_keys_limit_holds_and_is_used_across_two_edges_under_load_and_churn(
    tmp_path: Path,
) -> None:
    reason = why_postgres_cannot_run()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    print("\n" + run.stdout)
    figures = json.loads(out.read_text())
    steady, churn = figures["steady"], figures["churn"]

    assert steady["peak"] <= LIMIT
    assert steady["store_peak"] <= LIMIT  # the slots held in PostgreSQL, sampled
    assert steady["mean"] >= 0.9 * LIMIT, steady
    assert steady["store_mean"] >= 0.9 * LIMIT, steady

    assert churn["from_kill_until_freed"]["peak"] <= LIMIT
    assert churn["slots_freed_after_s"] <= TTL_S + 3, churn  # one TTL, and a busy machine's lag
    # back at the limit once the slots are freed (the windows after that are all >= 90%)
    assert churn["engine_back_at_limit_after_s"] <= churn["slots_freed_after_s"] + 1.5, churn
    after = churn["after_restart"]
    assert after["peak"] <= LIMIT
    assert after["store_peak"] <= LIMIT
    assert after["mean"] >= 0.9 * LIMIT, after

    requests = figures["requests"]
    assert requests["ok"] > 0
    assert requests["refused_429"] > 0  # demand exceeded the limit all along
    # nothing but 200, 429 and the killed edge's cut connections, but for a 503 or two
    # while edge-2 starts again: the balancer (no health check) sends it requests once it
    # listens, before its node has linked to it again
    assert set(requests["other"]) <= {503}, requests
    assert sum(requests["other"].values()) == churn["other_while_edge_2_started"], figures
