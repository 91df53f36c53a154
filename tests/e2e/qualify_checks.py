"""What a qualification report must hold to be honest, whatever the model answered:
shared by the llama.cpp test (``test_qualify_llamacpp``) and the vLLM one
(tests/vllm/test_vllm_devstack.py). Never the model's text: the report's shape, its
verdicts carrying a reason when they fail, determinism counted, the engine named."""

from __future__ import annotations

import io
from typing import Any

from iop_edge.cli.iopctl import run

LEVELS = (1, 2)
FAST = (
    "--levels", "1,2", "--rounds", "1", "--max-tokens", "8", "--determinism-runs", "3",
    "--context-timeout", "30",
)  # fmt: skip


async def iopctl(url: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await run(["--url", url, *argv], out, err)
    return code, out.getvalue(), err.getvalue()


def check_report(report: dict[str, Any], model: str, provider: str, engine: str) -> None:
    assert report["kind"] == "iop.qualification/v1"
    assert report["id"].startswith("qual_")
    assert (report["model"], report["provider_id"]) == (model, provider)
    # the engine as the node asked it, and the device
    assert report["engine"]["name"] == engine
    assert report["engine"]["version"], report["engine"]
    assert report["engine"]["device"], report["engine"]
    assert report["engine"]["listed_models"] >= 1
    # performance at each level, through the pool, pinned: every request answered
    assert [row["concurrency"] for row in report["performance"]] == list(LEVELS)
    for row in report["performance"]:
        assert row["failed"] == 0, row
        assert row["requests"] == row["concurrency"]
        assert row["ttft_p50_ms"] is not None
        assert row["ttft_p50_ms"] > 0
        assert row["tokens_per_s_aggregate"] > 0
        assert row["completion_tokens"] > 0
    context = report["context"]
    assert context["reached_tokens"] >= 256, context
    assert context["stopped"] in ("context overflow", "declared context window", "time bound")
    # pass or fail, each with its reason when it fails: a 135M model's failure is a result
    for check in (report["tool_call"], report["json_schema"]):
        assert isinstance(check["passed"], bool)
        assert check["passed"] or check["reason"], check
    determinism = report["determinism"]
    assert determinism["runs"] == 3
    assert determinism["answered"] == 3
    assert 1 <= determinism["distinct"] <= 3
    assert determinism["identical"] == (determinism["distinct"] == 1)
    lifecycle = report["lifecycle"]
    assert lifecycle["list_models"] == {
        "claimed": True,
        "checked": "pass",
        "reason": f"its probe listed {report['engine']['listed_models']} model(s)",
    }
    assert lifecycle["load_model"]["checked"] == "not checked"
    summary = report["summary"]
    assert summary["tool_call"] == ("pass" if report["tool_call"]["passed"] else "fail")
    assert summary["deterministic"] == determinism["identical"]
    assert summary["context_reached_tokens"] == context["reached_tokens"]
