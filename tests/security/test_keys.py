"""API keys as trust boundaries, against the real stack: what a key sees, and when it stops.

- A restricted key sees only its own runs and only the models (and the providers
  serving them) its allow-list admits; an operator key sees everything.
- Revoking a key ends its running stream (an SSE ``error`` event) and its queued
  request (a 401) at once (the control-plane polls every 0.25 s and pushes: well under a
  second on a quiet machine, printed), long before the stream would have ended, while
  another key's stream goes on.
- With no keys configured the edge serves loopback clients only, unless
  ``http.allow_open`` is true; a client in a network namespace (a veth pair with
  private addresses, no other route) plays the remote one.

Keys are issued and revoked with the control-plane's CLI; clients use the official
OpenAI SDK. The secure-default test runs first: it needs a stack without keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
import yaml
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS_PER_SECOND = 50
# The revoked stream would run 20 s: ending within this bound can only be the revocation's
# doing. Generous for a loaded machine; the latency itself is printed, not asserted.
REVOKED_WITHIN_S = 5.0
KEEPER_SECONDS = 15  # how long the keeper's stream holds 'solo'


def mock(provider_id: str, served: list[str], capacity: int = 2) -> dict[str, object]:
    return {
        "id": provider_id,
        "type": "mock",
        "category": "local_inference",
        "models": served,
        "capacity": capacity,
        "max_queue": 4,
        "queue_timeout_ms": 20_000,  # a queued request waits for the revocation, not less
        "request_timeout_ms": 30_000,
        "tokens_per_second": TOKENS_PER_SECOND,
    }


# node-b-mock serves two public models: a key allowed only one of them still sees
# that provider, listing only the allowed one.
FLEET: dict[str, object] = {
    "models": [
        {"id": "mock-small", "providers": {"node-a-mock": "small-a", "node-b-mock": "small-b"}},
        {"id": "solo", "providers": {"node-a-solo": "solo-served"}},
        {"id": "twin", "providers": {"node-b-mock": "twin-served"}},
    ],
    "nodes": [
        {
            "id": "node-a",
            "providers": [
                mock("node-a-mock", ["small-a"]),
                mock("node-a-solo", ["solo-served"], capacity=1),
            ],
        },
        {"id": "node-b", "providers": [mock("node-b-mock", ["small-b", "twin-served"])]},
        {"id": "node-fuzz", "providers": []},
    ],
}


@dataclass(frozen=True)
class Key:
    key_id: str
    secret: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[Any]:
    async with start_stack_factory(Path(tmp_path_factory.mktemp("keys")), FLEET) as running:
        yield running


def api_port(stack: Any) -> int:
    return int(stack.api_url.rsplit(":", 1)[1].split("/", 1)[0])


def sdk(stack: Any, key: Key | str) -> AsyncOpenAI:
    secret = key.secret if isinstance(key, Key) else key
    return AsyncOpenAI(base_url=stack.api_url, api_key=secret, max_retries=0, timeout=30)


async def get_json(stack: Any, path: str, key: Key) -> tuple[int, Any]:
    base = stack.api_url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {key.secret}"}
    async with aiohttp.ClientSession() as http, http.get(base + path, headers=headers) as r:
        return r.status, await r.json()


async def issue(stack: Any, name: str, *options: str) -> Key:
    """A key from the CLI, once the edge knows it (an unknown key is refused by then)."""
    out = await stack.control_plane_cli("key", "issue", "--name", name, *options)
    key_id = re.search(r"\bkey_[0-9a-f]+\b", out)
    secret = re.search(r"sk-iop-\S+", out)
    assert key_id is not None, out
    assert secret is not None, out
    key = Key(key_id.group(0), secret.group(0))

    async def known() -> bool:
        ours = await get_json(stack, "/v1/models", key)
        bogus = await get_json(stack, "/v1/models", Key("", "sk-iop-not-a-key"))
        return ours[0] == 200 and bogus[0] == 401

    async with asyncio.timeout(10):
        while not await known():  # noqa: ASYNC110 - the key lives in other processes
            await asyncio.sleep(0.05)
    return key


async def iopctl_providers(stack: Any, key: Key) -> set[str]:
    """The operator's terminal view (the console's endpoints) through ``key``."""
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iopctl"),
        *("providers", "--json", "--url", stack.api_url.removesuffix("/v1"), "--key", key.secret),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    return {row["provider_id"] for row in json.loads(out)}


async def chat_run_id(client: AsyncOpenAI, model: str) -> str:
    completion = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    return completion.id.removeprefix("chatcmpl-")


# --- the secure default (first: the stack has no keys yet) -------------------------------


@pytest.fixture(scope="module")
def namespace(netns_factory: Any) -> Iterator[Any]:
    """A client on another host: a network namespace behind a veth pair (tests/conftest.py)."""
    with netns_factory("k", 213) as ns:
        yield ns


# Run inside the namespace: list models through the SDK, print what came back.
REMOTE_CLIENT = """
import json, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-iop-none", max_retries=0, timeout=10)
try:
    print(json.dumps({"status": 200, "models": [m.id for m in client.models.list()]}))
except openai.APIStatusError as exc:
    print(json.dumps({"status": exc.status_code, "message": exc.message}))
"""


async def remote_models(ns: Any, port: int) -> dict[str, Any]:
    url = f"http://{ns.host_address}:{port}/v1"
    done = await asyncio.to_thread(ns.run, sys.executable, "-c", REMOTE_CLIENT, url)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def restart_edge(stack: Any, **http: object) -> Any:
    await stack.stop("edge")
    settings_file = stack.root / "edge.yaml"
    settings = yaml.safe_load(settings_file.read_text())
    settings["http"] = {"port": api_port(stack), **http}
    settings_file.write_text(yaml.safe_dump(settings))
    edge = await stack.start("edge")
    stack.edge_admin = edge.admin_url
    await stack.wait_registered(("node-a", "node-b"))
    return edge


async def test_without_keys_only_loopback_clients_are_served(stack: Any, namespace: Any) -> None:
    port = api_port(stack)
    try:
        # Bound to every interface, no key issued: loopback yes, the namespace no.
        edge = await restart_edge(stack, host="0.0.0.0")
        async with sdk(stack, "sk-iop-none") as local:
            assert {m.id async for m in local.models.list()} == {"mock-small", "solo", "twin"}
        refused = await remote_models(namespace, port)
        assert refused["status"] == 401, refused
        assert "no API keys" in refused["message"]
        assert "http.allow_open: true" in refused["message"]
        # ... and the edge said so when it started
        await asyncio.wait_for(edge.wait_for_line("serves loopback clients only"), 5)

        # Said explicitly, the open API serves the namespace too.
        edge = await restart_edge(stack, host="0.0.0.0", allow_open=True)
        await asyncio.wait_for(edge.wait_for_line("http.allow_open is true"), 5)
        served = await remote_models(namespace, port)
        assert served == {"status": 200, "models": ["mock-small", "solo", "twin"]}
    finally:
        await restart_edge(stack, host="127.0.0.1")


async def test_revoking_the_last_key_leaves_keys_required(stack: Any) -> None:
    """Once a key was issued, the API never falls back to serving loopback clients without
    one: revoking the only key leaves every request refused, that key's included."""
    only = await issue(stack, "only")  # the module's first key: none before it
    await stack.control_plane_cli("key", "revoke", only.key_id)
    async with asyncio.timeout(10):
        while (await get_json(stack, "/v1/models", only))[0] != 401:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    for secret in (only.secret, "sk-iop-none"):
        async with sdk(stack, secret) as local:
            with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
                await local.chat.completions.create(
                    model="mock-small", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
    base = stack.api_url.removesuffix("/v1")
    async with aiohttp.ClientSession() as http, http.get(base + "/v1/models") as keyless:
        assert keyless.status == 401


# --- runs and catalog per key ------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenants(stack: Any) -> dict[str, Key]:
    """Two restricted keys: one for 'mock-small', one for 'solo'."""
    small = await issue(stack, "tenant-small", "--models", "mock-small")
    solo = await issue(stack, "tenant-solo", "--models", "solo")
    return {"small": small, "solo": solo}


async def test_a_key_sees_only_its_own_runs(stack: Any, tenants: dict[str, Key]) -> None:
    small, solo = tenants["small"], tenants["solo"]
    async with sdk(stack, small) as client:
        small_run = await chat_run_id(client, "mock-small")
    async with sdk(stack, solo) as client:
        solo_run = await chat_run_id(client, "solo")

    _, seen_by_small = await get_json(stack, "/iop/v1/runs?limit=1000", small)
    _, seen_by_solo = await get_json(stack, "/iop/v1/runs?limit=1000", solo)
    small_ids = {run["run_id"] for run in seen_by_small["data"]}
    solo_ids = {run["run_id"] for run in seen_by_solo["data"]}
    assert small_run in small_ids
    assert solo_run not in small_ids
    assert solo_run in solo_ids
    assert small_run not in solo_ids
    assert {run["key_id"] for run in seen_by_small["data"]} == {small.key_id}
    assert {run["key_id"] for run in seen_by_solo["data"]} == {solo.key_id}


async def test_a_key_sees_only_the_models_it_may_use_in_the_catalog(
    stack: Any, tenants: dict[str, Key]
) -> None:
    small = tenants["small"]
    status, models = await get_json(stack, "/iop/v1/catalog/models", small)
    assert status == 200
    assert [m["id"] for m in models["data"]] == ["mock-small"]
    _, providers = await get_json(stack, "/iop/v1/catalog/providers", small)
    rows = {p["provider_id"]: p for p in providers["data"]}
    assert set(rows) == {"node-a-mock", "node-b-mock"}  # not node-a-solo
    # node-b-mock also serves 'twin', which this key may not use: it is not listed.
    assert (rows["node-b-mock"]["serves"], rows["node-b-mock"]["models"]) == (
        ["mock-small"],
        ["small-b"],
    )
    assert (rows["node-a-mock"]["serves"], rows["node-a-mock"]["models"]) == (
        ["mock-small"],
        ["small-a"],
    )
    # The same as /v1/models shows it, and the operator tools with this key.
    async with sdk(stack, small) as client:
        assert [m.id async for m in client.models.list()] == ["mock-small"]
    assert await iopctl_providers(stack, small) == {"node-a-mock", "node-b-mock"}


async def test_an_operator_key_sees_every_run_and_the_whole_catalog(
    stack: Any, tenants: dict[str, Key]
) -> None:
    # Restricted to 'solo' for inference, yet an operator: it sees all of it.
    operator = await issue(stack, "ops", "--operator", "--models", "solo")
    async with sdk(stack, tenants["small"]) as client:
        small_run = await chat_run_id(client, "mock-small")
    async with sdk(stack, tenants["solo"]) as client:
        solo_run = await chat_run_id(client, "solo")

    _, runs = await get_json(stack, "/iop/v1/runs?limit=1000", operator)
    by_id = {run["run_id"]: run for run in runs["data"]}
    assert by_id[small_run]["key_id"] == tenants["small"].key_id
    assert by_id[solo_run]["key_id"] == tenants["solo"].key_id
    _, models = await get_json(stack, "/iop/v1/catalog/models", operator)
    assert [m["id"] for m in models["data"]] == ["mock-small", "solo", "twin"]
    _, providers = await get_json(stack, "/iop/v1/catalog/providers", operator)
    rows = {p["provider_id"]: p for p in providers["data"]}
    assert set(rows) == {"node-a-mock", "node-a-solo", "node-b-mock"}
    assert rows["node-b-mock"]["serves"] == ["mock-small", "twin"]
    assert await iopctl_providers(stack, operator) == {"node-a-mock", "node-a-solo", "node-b-mock"}
    listing = await stack.control_plane_cli("key", "list", "--json")
    flags = {key["key_id"]: key["operator"] for key in json.loads(listing)}
    assert flags[operator.key_id] is True
    assert flags[tenants["small"].key_id] is False


async def test_only_an_operator_key_reads_the_fleet_s_history(
    stack: Any, tenants: dict[str, Key]
) -> None:
    """The history is every key's traffic (the console's plots): a key that is not an
    operator's is refused it, not shown a part of it."""
    operator = await issue(stack, "ops-history", "--operator")
    async with sdk(stack, tenants["small"]) as client:
        await chat_run_id(client, "mock-small")
    status, refused = await get_json(stack, "/iop/v1/history", tenants["small"])
    assert (status, refused["error"]["code"]) == (403, "operator_only")
    async with asyncio.timeout(20):
        while True:  # the run log is written in batches, by the edge's writer
            status, history = await get_json(stack, "/iop/v1/history", operator)
            assert status == 200, history
            seen = {(s["model"], sum(s["requests"])) for s in history["data"]}
            if any(model == "mock-small" and n >= 1 for model, n in seen):
                break
            await asyncio.sleep(0.2)


# --- revocation --------------------------------------------------------------------------


@dataclass
class Ended:
    at: float = 0.0
    error: openai.APIError | None = None
    deltas: int = 0
    finished: bool = False
    run_id: str = ""


async def stream_until_end(client: AsyncOpenAI, model: str, tokens: int, seen: Ended) -> None:
    """Stream ``tokens`` words; note when (and how) the stream ended."""
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=tokens,
            stream=True,
            extra_body={"iop_mock": {"fill": True}},  # ``tokens`` words, not a short answer
        )
        async for chunk in stream:
            seen.run_id = chunk.id.removeprefix("chatcmpl-")
            if chunk.choices and chunk.choices[0].delta.content:
                seen.deltas += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                seen.finished = True
    except openai.APIError as exc:
        seen.error = exc
    seen.at = time.monotonic()


async def collect_until_end(client: AsyncOpenAI, model: str, seen: Ended) -> None:
    try:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "wait"}], max_tokens=2
        )
        seen.finished = True
    except openai.APIError as exc:
        seen.error = exc
    seen.at = time.monotonic()


async def node_outcome(stack: Any, run_id: str) -> tuple[str, int]:
    """How a node's own run history (SQLite, read-only) says the run ended, once it has:
    its outcome and the tokens it produced."""

    def read() -> tuple[str, int] | None:
        for node in ("node-a", "node-b"):
            uri = f"file:{stack.root / f'{node}-history.db'}?mode=ro"
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
                row = db.execute(
                    "SELECT outcome, completion_tokens FROM runs WHERE run_id = ?",
                    (run_id,),
                ).fetchone()
            if row is not None and row[0] != "running":
                return str(row[0]), int(row[1])
        return None

    async with asyncio.timeout(10):
        while (found := await asyncio.to_thread(read)) is None:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.1)
    return found


async def in_flight(stack: Any, key: Key) -> dict[str, int]:
    _, providers = await get_json(stack, "/iop/v1/catalog/providers", key)
    return {p["provider_id"]: p["in_flight"] for p in providers["data"]}


async def test_revoking_a_key_ends_its_stream_and_its_queued_request_at_once(
    stack: Any,
) -> None:
    victim = await issue(stack, "victim")
    keeper = await issue(stack, "keeper")
    victim_stream, victim_queued, keeper_stream = Ended(), Ended(), Ended()
    async with sdk(stack, victim) as doomed, sdk(stack, keeper) as kept:
        tasks = [
            # the keeper fills 'solo' (capacity 1) for longer than the test needs, also on
            # a busy machine, where the revoke command alone has taken 9 s
            asyncio.create_task(
                stream_until_end(kept, "solo", KEEPER_SECONDS * TOKENS_PER_SECOND, keeper_stream)
            ),
            asyncio.create_task(
                stream_until_end(doomed, "mock-small", 20 * TOKENS_PER_SECOND, victim_stream)
            ),
        ]
        try:
            async with asyncio.timeout(10):
                while not (victim_stream.deltas and keeper_stream.deltas):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            # ... so the victim's request for 'solo' waits in the edge's queue
            tasks.append(asyncio.create_task(collect_until_end(doomed, "solo", victim_queued)))
            async with asyncio.timeout(5):
                while True:
                    _, models = await get_json(stack, "/iop/v1/catalog/models", keeper)
                    if {m["id"]: m["queued"] for m in models["data"]}["solo"] == 1:
                        break
                    await asyncio.sleep(0.02)
            assert (await in_flight(stack, keeper))["node-a-solo"] == 1

            command_started = time.monotonic()
            await stack.control_plane_cli("key", "revoke", victim.key_id)
            revoked_at = time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REVOKED_WITHIN_S):
                    while not (victim_stream.at and victim_queued.at):  # noqa: ASYNC110
                        await asyncio.sleep(0.01)
            assert victim_stream.at, "the revoked key's stream was still running 5 s later"
            assert victim_queued.at, "the revoked key's queued request was still waiting 5 s later"
            stream_latency = victim_stream.at - revoked_at
            queued_latency = victim_queued.at - revoked_at
            print(
                f"revoke command took {revoked_at - command_started:.3f}s; after it returned, "
                f"the stream ended in {stream_latency:.3f}s, the queued request in "
                f"{queued_latency:.3f}s (negative: before it returned)"
            )

            # The started stream: an SSE error event (the SDK raises it), then the end.
            assert isinstance(victim_stream.error, openai.APIError)
            assert not isinstance(victim_stream.error, openai.APIStatusError)  # status was 200
            assert victim_stream.error.code == "invalid_api_key"
            assert "revoked" in victim_stream.error.message
            assert not victim_stream.finished
            # The queued request: a 401 with the same reason.
            assert isinstance(victim_queued.error, openai.AuthenticationError)
            assert victim_queued.error.code == "invalid_api_key"
            assert "revoked" in victim_queued.error.message
            assert stream_latency < REVOKED_WITHIN_S
            assert queued_latency < REVOKED_WITHIN_S

            # The victim's run was cancelled on the node: its slot is free again, while
            # the keeper's stream still holds 'solo' and is still going.
            async with asyncio.timeout(5):
                while True:
                    flights = await in_flight(stack, keeper)
                    if flights["node-a-mock"] + flights["node-b-mock"] == 0:
                        break
                    await asyncio.sleep(0.05)
            assert flights["node-a-solo"] == 1
            assert not keeper_stream.at
            # ... and the node stopped it (its own history says so).
            outcome, tokens = await node_outcome(stack, victim_stream.run_id)
            assert outcome == "cancelled"
            assert tokens < 20 * TOKENS_PER_SECOND

            await asyncio.wait_for(tasks[0], KEEPER_SECONDS + 15)
            assert keeper_stream.error is None
            assert keeper_stream.finished
            assert keeper_stream.deltas == KEEPER_SECONDS * TOKENS_PER_SECOND
            # The revoked key is refused from now on; the keeper goes on.
            async with sdk(stack, victim) as again:
                with pytest.raises(openai.AuthenticationError):
                    await again.models.list()
            async with sdk(stack, keeper) as client:
                await chat_run_id(client, "solo")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    _, runs = await get_json(stack, "/iop/v1/runs?limit=20", keeper)
    assert {run["key_id"] for run in runs["data"]} == {keeper.key_id}
