"""``make run VLLM=1`` for real: ``smollm2:135m`` from a pool of llama.cpp and vLLM.

``tools/devstack.py --vllm`` is started as ``make run VLLM=1`` starts it (on shifted
ports, files under ``tmp_path``), with ``test_local_stack``'s harness. The seed's central
scenario on real engines: one public model id, two provider types on two nodes, each
with its own served name, and concurrent requests spread by load ratio, so both answer.
This stack starts a vLLM of its own (the program's, not the session's).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

E2E = Path(__file__).resolve().parents[1] / "e2e"
MODEL = "smollm2:135m"
UP_WITHIN_S = 420.0
CONTEXT_TIMEOUT_S = 60
"""The context probe's time (``--context-timeout``; the fast suite's 30 s suits llama.cpp).
vLLM on a slow 2-core machine took about 15 s to prefill each of the probe's 256- and
512-word prompts, and only the one after them, past its 1,024-token window, is refused:
29.5 s for the two in one run, a hair inside 30 s, and about 31 s in the next (a time
bound where the report must say context overflow)."""


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"iop_vllm_{name}", E2E / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


local = _load("test_local_stack")
qualify = _load("qualify_checks")
certs = local.certs  # the fixture, under this module's name


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            assert response.status == 200, await response.text()
            return await response.json()


async def test_make_run_vllm_serves_one_model_from_llamacpp_and_vllm(
    tmp_path: Path, certs: Path, vllm_installed: None
) -> None:
    if (reason := local.missing_llamacpp()) is not None:
        pytest.skip(f"the real llama.cpp provider cannot run: {reason}")

    async with local.local_stack(tmp_path, certs, vllm=True, up_within_s=UP_WITHIN_S) as (
        running,
        up,
    ):
        assert set(running.pid_files()) == {*local.NAMES, "vllm"}, running.output
        rows = {row["provider_id"]: row for row in (await get_json(up["catalog"]))["data"]}
        assert rows["node-a-llamacpp"]["health"] == rows["node-b-vllm"]["health"] == "available"
        assert (rows["node-a-llamacpp"]["type"], rows["node-b-vllm"]["type"]) == (
            "llamacpp",
            "vllm",
        )
        assert rows["node-a-llamacpp"]["node_id"] == "node-a"
        assert rows["node-b-vllm"]["node_id"] == "node-b"
        models = {
            m["id"]: m
            for m in (await get_json(up["catalog"].replace("providers", "models")))["data"]
        }
        assert models[MODEL]["providers"] == {
            "node-a-llamacpp": MODEL,
            "node-b-vllm": "smollm2-135m-vllm",
        }
        assert sorted(models[MODEL]["available_providers"]) == ["node-a-llamacpp", "node-b-vllm"]

        async with AsyncOpenAI(base_url=up["api"], api_key="unused", max_retries=0) as sdk:
            # Five at once: llama.cpp's one slot and vLLM's four (load ratio decides).
            answers = await asyncio.gather(
                *(
                    sdk.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Say hello to {n}."}],
                        max_tokens=16,
                    )
                    for n in range(5)
                )
            )
        assert all(a.model == MODEL for a in answers)
        assert all(a.usage is not None and a.usage.completion_tokens > 0 for a in answers)
        runs = (await get_json(up["api"].replace("/v1", "/iop/v1/runs?limit=20")))["data"]
        served = Counter(r["provider_id"] for r in runs if r["model"] == MODEL)
        assert set(served) == {"node-a-llamacpp", "node-b-vllm"}, served
        assert sum(served.values()) == 5

        await check_qualification_of_both(up["api"].removesuffix("/v1"))

        code = await running.stop()
    assert code == 0, running.output
    assert "stopping vLLM" in running.output


async def check_qualification_of_both(edge: str) -> None:
    """``iopctl qualify`` of the alias: a report per provider, pinned through the pool,
    each with its engine's version (vLLM's release, llama.cpp's build), then the two
    providers compared (docs/ARCHITECTURE.md#qualification-reports)."""
    code, out, err = await qualify.iopctl(
        edge, "qualify", MODEL, *qualify.FAST, "--context-timeout", str(CONTEXT_TIMEOUT_S), "--json"
    )
    assert code == 0, err
    reports = {r["provider_id"]: r for r in json.loads(out)}
    assert set(reports) == {"node-a-llamacpp", "node-b-vllm"}
    qualify.check_report(reports["node-a-llamacpp"], MODEL, "node-a-llamacpp", "llamacpp")
    vllm = reports["node-b-vllm"]
    qualify.check_report(vllm, MODEL, "node-b-vllm", "vllm")
    assert vllm["served_as"] == "smollm2-135m-vllm"
    assert re.fullmatch(r"\d+\.\d+.*", vllm["engine"]["version"]), vllm["engine"]
    # vLLM's max_model_len (1024) is below llama.cpp's 8192: the report says so
    assert vllm["context"]["stopped"] == "context overflow", vllm["context"]
    assert vllm["context"]["reached_tokens"] < 1024
    llama, vllm_id = reports["node-a-llamacpp"]["id"], vllm["id"]
    code, out, err = await qualify.iopctl(edge, "qualify", "compare", llama, vllm_id, "--json")
    assert code == 0, err
    rows = {row["metric"]: row for row in json.loads(out)["rows"]}
    assert rows["provider"]["a"] == "node-a/node-a-llamacpp"
    assert rows["provider"]["b"] == "node-b/node-b-vllm"
    assert rows["engine"]["b"] == f"vllm {vllm['engine']['version']}"
    assert rows["context reached"]["b"] == vllm["context"]["reached_tokens"]
    assert {"c=1 ttft p50 ms", "c=2 tok/s aggregate"} <= set(rows)
    code, out, err = await qualify.iopctl(edge, "qualify", "compare", llama, vllm_id)
    assert code == 0, err
    assert "node-b/node-b-vllm" in out
