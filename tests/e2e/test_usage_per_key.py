"""Who used what, on the real stack: keys issued by the control-plane's CLI make runs
through every API (the official OpenAI and Anthropic SDKs) and a batch (a real worker);
the run log, the metrics, ``GET /iop/v1/usage`` and ``iopctl usage`` each say which key
and which API, with the numbers that were sent; a key that is not an operator's sees
its own usage only (docs/ARCHITECTURE.md#usage-per-key)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any
MODEL = "mock-small"
WAIT_S = 90.0  # generous: a busy machine, a worker polling, a run log written in batches


async def issue(stack: Stack, name: str, *options: str) -> tuple[str, str]:
    """A key from the CLI once the edge serves it: its id and its secret."""
    secret = await stack.issue_key(name, *options)
    out = await stack.control_plane_cli("key", "list")
    line = next(line for line in out.splitlines() if re.search(rf"\b{name}\b", line))
    found = re.search(r"\bkey_[0-9a-f]+\b", line)
    assert found is not None, out
    return found.group(0), secret


def openai_sdk(stack: Stack, secret: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0)


def edge_url(stack: Stack) -> str:
    return str(stack.api_url).removesuffix("/v1")


async def get(stack: Stack, path: str, secret: str) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {secret}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{edge_url(stack)}{path}", headers=headers) as response:
            return response.status, await response.json()


async def runs_of(stack: Stack, operator: str, count: int) -> list[dict[str, Any]]:
    """The run log's records once it holds ``count`` of them (an operator sees all)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            status, body = await get(stack, "/iop/v1/runs?limit=1000", operator)
            assert status == 200, body
            if len(body["data"]) >= count:
                return list(body["data"])
            await asyncio.sleep(0.2)  # the records come from other processes' work


async def run_batch(sdk: AsyncOpenAI, lines: int) -> None:
    content = "".join(
        json.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {n}"}]},
            }
        )
        + "\n"
        for n in range(lines)
    )
    upload = await sdk.files.create(file=("lines.jsonl", content.encode()), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    async with asyncio.timeout(WAIT_S):
        while batch.status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing"), batch
            await asyncio.sleep(0.2)  # the worker is another process
            batch = await sdk.batches.retrieve(batch.id)
    assert batch.request_counts is not None
    assert batch.request_counts.completed == lines


async def iopctl(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iopctl"),
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


async def test_the_run_log_metrics_usage_and_iopctl_say_which_key_and_api(stack: Stack) -> None:
    ops_id, ops = await issue(stack, "ops", "--operator")
    alice_id, alice = await issue(stack, "alice")
    bob_id, bob = await issue(stack, "bob", "--max-concurrent", "3")

    sent: Counter[tuple[str, str]] = Counter()  # (key id, api) -> requests
    async with openai_sdk(stack, alice) as sdk:
        chat = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        _ = [chunk async for chunk in stream]
        await sdk.completions.create(model=MODEL, prompt="once upon", max_tokens=5)
        await sdk.embeddings.create(model=MODEL, input="embed me")
        await sdk.responses.create(model=MODEL, input="tell me something", max_output_tokens=5)
        with pytest.raises(Exception, match="does not exist"):
            await sdk.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
    sent.update({(alice_id, "chat_completions"): 3, (alice_id, "completions"): 1})
    sent.update({(alice_id, "embeddings"): 1, (alice_id, "responses"): 1})
    async with AsyncAnthropic(base_url=edge_url(stack), api_key=bob, max_retries=0) as claude:
        for _ in range(2):
            await claude.messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
    sent[bob_id, "messages"] = 2
    async with openai_sdk(stack, bob) as sdk:
        await run_batch(sdk, 3)
    sent[bob_id, "batch"] = 3
    assert chat.usage is not None

    # The run log: every record says its key and its API.
    records = await runs_of(stack, ops, sum(sent.values()))
    assert Counter((r["key_id"], r["api"]) for r in records) == sent
    (failed,) = [r for r in records if r["outcome"] != "completed"]
    assert (failed["key_id"], failed["api"], failed["status"]) == (
        alice_id,
        "chat_completions",
        404,
    )
    batch_runs = [r for r in records if r["api"] == "batch"]
    assert {(r["model"], r["operation"], r["stream"]) for r in batch_runs} == {
        (MODEL, "chat_completions", False)
    }
    # A non-operator key's run history is its own.
    status, own = await get(stack, "/iop/v1/runs?limit=1000", alice)
    assert status == 200
    assert {r["key_id"] for r in own["data"]} == {alice_id}

    # The metrics: requests and tokens by model, provider, key and API.
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.edge_admin}/metrics") as response:
            text = await response.text()
    requests = Counter[tuple[str, str]]()
    for labels, value in metric_samples(text, "iop_edge_requests_total"):
        requests[labels["key"], labels["api"]] += int(value)
    assert requests == sent
    tokens = Counter[tuple[str, str]]()
    for labels, value in metric_samples(text, "iop_edge_tokens_total"):
        if labels["kind"] == "prompt":
            tokens[labels["key"], labels["api"]] += int(value)
    logged = Counter[tuple[str, str]]()
    for r in records:
        logged[r["key_id"], r["api"]] += r["prompt_tokens"]
    assert tokens == +logged  # the failed run had none
    assert logged[bob_id, "batch"] > 0  # a batch line's tokens are counted too

    # The usage endpoint: the operator sees every key, with the numbers that were sent.
    status, usage = await get(stack, "/iop/v1/usage", ops)
    assert status == 200, usage
    views = {v["key_id"]: v for v in usage["data"]}
    assert set(views) == {ops_id, alice_id, bob_id}
    for key_id in (alice_id, bob_id):
        day = views[key_id]["day"]
        assert {api: c["requests"] for api, c in day["by_api"].items()} == {
            api: n for (k, api), n in sent.items() if k == key_id
        }
        mine = [r for r in records if r["key_id"] == key_id]
        assert day["input_tokens"] == sum(r["prompt_tokens"] for r in mine)
        assert day["output_tokens"] == sum(r["completion_tokens"] for r in mine)
        assert views[key_id]["period"]["requests"] == len(mine)
    assert views[alice_id]["day"]["errors"] == 1
    chat_tokens = views[alice_id]["day"]["by_api"]["chat_completions"]["input_tokens"]
    assert chat_tokens >= chat.usage.prompt_tokens > 0  # what the client was told is in it
    assert (views[bob_id]["max_concurrent"], views[bob_id]["in_flight"]) == (3, 0)
    assert views[bob_id]["limits"]["token_budget"] == 0  # none issued: unlimited
    assert views[ops_id]["day"]["requests"] == 0

    # A key that is not an operator's sees its own usage only.
    status, own_usage = await get(stack, "/iop/v1/usage", alice)
    assert status == 200
    assert [v["key_id"] for v in own_usage["data"]] == [alice_id]
    assert own_usage["data"][0]["day"] == views[alice_id]["day"]
    for other in (bob_id, "bob"):
        status, refused = await get(stack, f"/iop/v1/usage?key={other}", alice)
        assert status == 404, refused
    status, one = await get(stack, "/iop/v1/usage?key=bob", ops)
    assert [v["key_id"] for v in one["data"]] == [bob_id]

    # iopctl shows the same.
    code, out, err = await iopctl("usage", "--url", edge_url(stack), "--key", ops)
    assert code == 0, err
    keys_table, *_, apis_table = out.split("\n\n")  # keys, (per-model limits), APIs
    rows = {line.split()[0]: line.split() for line in keys_table.splitlines()[1:]}
    assert rows[bob_id][1] == "bob"
    assert rows[bob_id][6] == str(sent[bob_id, "messages"] + sent[bob_id, "batch"])  # REQ_TODAY
    assert "0/3" in rows[bob_id]  # in flight against max_concurrent
    assert "unlimited" in rows[alice_id][2]  # no rate issued
    api_lines = [line.split() for line in apis_table.splitlines() if line.startswith(bob_id)]
    assert {line[1]: line[3] for line in api_lines if line[1] in ("batch", "messages")} == {
        "batch": "3",
        "messages": "2",
    }
    code, out, err = await iopctl(
        "usage", "alice", "--json", "--url", edge_url(stack), "--key", ops
    )
    assert code == 0, err
    assert [v["key_id"] for v in json.loads(out)] == [alice_id]
    code, out, err = await iopctl("usage", "bob", "--url", edge_url(stack), "--key", alice)
    assert code == 1
    assert "404" in err
