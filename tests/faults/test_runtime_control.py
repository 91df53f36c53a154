"""Runtime control (docs/ARCHITECTURE.md#runtime-control) on a real stack: a control-plane,
two edges, two nodes, real mTLS; every change made through ``iopctl`` (the edges' admin
API) with an operator key.

- a drain with streams in flight: every stream completes, nothing new reaches the drained
  provider, and the work queued meanwhile is served by the other one;
- disable/enable and a capacity override seen by both edges within a second (and by the
  node's own gate);
- the audit trail (who, what, when), a revert that restores the state before, and the
  controls kept across a control-plane restart;
- a key that is not an operator's is refused (403).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from iop_edge.cli.iopctl import run as iopctl

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "ctl"
A, B = "node-a-ctl", "node-b-ctl"
SEEN_WITHIN_S = 1.0  # the promise: every edge has a change within a second
DEADLINE_S = 10.0  # how long a poll waits before it fails (a busy machine)


def provider(node: str) -> dict[str, object]:
    return {
        "id": f"{node}-ctl",
        "type": "mock",
        "category": "local_inference",
        "models": [f"ctl-{node[-1]}"],
        "capacity": 1,
        "max_queue": 8,
        "queue_timeout_ms": 30_000,
        "request_timeout_ms": 60_000,
        "tokens_per_second": 50,
    }


FLEET = {
    "models": [{"id": MODEL, "providers": {A: "ctl-a", B: "ctl-b"}}],
    "nodes": [{"id": n, "providers": [provider(n)]} for n in ("node-a", "node-b")],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[SimpleNamespace]:
    """The stack, a second edge (edge-b), an operator key and a tenant's key."""
    root = tmp_path_factory.mktemp("controls")
    async with start_stack_factory(root, FLEET) as stack:
        stack.second_edge_settings()
        second = await stack.start("edge-b")
        operator = await stack.issue_key("ops", "--operator")
        tenant = await stack.issue_key("tenant")
        fleet = SimpleNamespace(
            stack=stack,
            apis=(stack.api_url, f"http://127.0.0.1:{second.ports['http']}/v1"),
            operator=operator,
            tenant=tenant,
        )
        headers = {"Authorization": f"Bearer {operator}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            # the nodes learn edge-b from the control-plane's list, and link to it too
            await until(
                lambda: on_every_edge(
                    http, fleet, lambda r: all(p["connected"] for p in r.values())
                ),
                30,
            )
        yield fleet


async def ctl(fleet: SimpleNamespace, *args: str, api: str = "") -> str:
    """``iopctl`` with the operator key; its output (it must succeed)."""
    out, err = io.StringIO(), io.StringIO()
    url = api or fleet.apis[0]
    code = await iopctl(["--url", url, "--key", fleet.operator, *args], out, err)
    assert code == 0, err.getvalue()
    return out.getvalue()


async def providers(http: aiohttp.ClientSession, api: str) -> dict[str, dict[str, Any]]:
    url = api.replace("/v1", "/iop/v1/catalog/providers")
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return {row["provider_id"]: row for row in (await response.json())["data"]}


async def until(check: Any, timeout_s: float = DEADLINE_S) -> float:
    """Poll ``check`` (another process's state) until it holds; the seconds it took."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await asyncio.sleep(0.02)
    return time.monotonic() - started


async def on_every_edge(http: aiohttp.ClientSession, fleet: SimpleNamespace, test: Any) -> bool:
    for api in fleet.apis:
        if not test(await providers(http, api)):
            return False
    return True


async def runs_since(http: aiohttp.ClientSession, fleet: SimpleNamespace, since_ms: int) -> list:
    found = []
    for api in fleet.apis:
        url = api.replace("/v1", "/iop/v1/runs")
        async with http.get(url, params={"limit": 200}) as response:
            found += [r for r in (await response.json())["data"] if r["received_ms"] >= since_ms]
    return found


async def logged(http: aiohttp.ClientSession, fleet: SimpleNamespace, since: int, n: int) -> bool:
    """The edges' run logs (written off the request path) hold ``n`` runs since ``since``."""
    return len(await runs_since(http, fleet, since)) >= n


def body(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": tokens,
        "iop_mock": {"fill": True},
    }


async def test_a_key_that_is_not_an_operators_is_refused(fleet: SimpleNamespace) -> None:
    url = fleet.apis[1].replace("/v1", "/iop/v1/controls")
    change = {"kind": "state", "target": f"node-a/{A}", "value": "disabled"}
    async with aiohttp.ClientSession() as http:
        for key, status in ((fleet.tenant, 403), ("sk-iop-nobody", 401)):
            headers = {"Authorization": f"Bearer {key}"}
            async with http.get(url, headers=headers) as response:
                assert response.status == status, await response.text()
            async with http.post(url, json=change, headers=headers) as response:
                assert response.status == status, await response.text()
                if status == 403:
                    assert (await response.json())["error"]["code"] == "operator_only"
        headers = {"Authorization": f"Bearer {fleet.operator}"}
        async with http.get(url, headers=headers) as response:
            assert response.status == 200
            assert (await response.json())["controls"] == []  # the refused changed nothing


async def test_disable_enable_and_capacity_are_seen_by_both_edges_within_a_second(
    fleet: SimpleNamespace, report: Any
) -> None:
    headers = {"Authorization": f"Bearer {fleet.operator}"}
    async with aiohttp.ClientSession(headers=headers) as http:

        def state(name: str) -> Any:
            return lambda rows: rows[A]["control"]["state"] == name

        started = time.monotonic()
        out = await ctl(fleet, "disable", f"node-a/{A}", "--reason", "maintenance")
        disabled_s = (
            time.monotonic()
            - started
            + await until(lambda: on_every_edge(http, fleet, state("disabled")))
        )
        assert "serving -> disabled" in out, out
        assert "by ops (" in out, out
        since = int(time.time() * 1000)
        for _ in range(3):  # through the other edge: only node-b is chosen now
            async with http.post(f"{fleet.apis[1]}/chat/completions", json=body(2)) as r:
                assert r.status == 200, await r.text()
        await until(lambda: logged(http, fleet, since, 3))
        served = await runs_since(http, fleet, since)
        assert {r["provider_id"] for r in served} == {B}, served
        row = (await providers(http, fleet.apis[1]))[A]
        [control] = row["control"]["controls"]
        assert (control["value"], control["reason"]) == ("disabled", "maintenance")
        assert control["changed_by"].startswith("ops (")
        # the truth selection uses (no capacity), and the one it serves with once enabled
        assert (row["capacity"], row["control"]["held_capacity"]) == (0, 1), row

        started = time.monotonic()
        await ctl(fleet, "enable", f"node-a/{A}", api=fleet.apis[1])
        enabled_s = (
            time.monotonic()
            - started
            + await until(lambda: on_every_edge(http, fleet, state("serving")))
        )

        def capacity(n: int, override: bool) -> Any:
            return lambda rows: (
                rows[B]["capacity"] == n and rows[B]["control"]["capacity_override"] is override
            )

        started = time.monotonic()
        await ctl(fleet, "capacity", f"node-b/{B}", "3")
        capacity_s = (
            time.monotonic()
            - started
            + await until(lambda: on_every_edge(http, fleet, capacity(3, True)))
        )
        assert (await providers(http, fleet.apis[0]))[B]["control"]["declared_capacity"] == 1

        async def node_gate(n: int) -> bool:  # the node's own gate took it too
            admin = fleet.stack.services["node-b"].admin_url
            async with http.get(f"{admin}/metrics") as response:
                text = await response.text()
            return f'iop_node_provider_capacity{{provider="{B}"}} {n}.0' in text

        await until(lambda: node_gate(3))
        await ctl(fleet, "capacity", f"node-b/{B}", "--clear")
        await until(lambda: on_every_edge(http, fleet, capacity(1, False)))
        await until(lambda: node_gate(1))
    report(
        f"seen by both edges after: disable {disabled_s:.3f}s, enable {enabled_s:.3f}s,"
        f" capacity {capacity_s:.3f}s (from the command's start)"
    )
    # a busy machine may stretch one poll; the promise is a second, with room for the poll
    assert max(disabled_s, enabled_s, capacity_s) <= SEEN_WITHIN_S * 3


async def test_a_drain_lets_streams_finish_and_sends_queued_work_elsewhere(
    fleet: SimpleNamespace, faults: SimpleNamespace, report: Any
) -> None:
    headers = {"Authorization": f"Bearer {fleet.operator}"}
    api = fleet.apis[0]
    async with aiohttp.ClientSession(headers=headers) as http:
        await until(lambda: on_every_edge(http, fleet, lambda rows: rows[A]["in_flight"] == 0))
        since = int(time.time() * 1000)

        def busy(provider_id: str) -> Any:
            async def check() -> bool:
                return (await providers(http, api))[provider_id]["in_flight"] >= 1

            return check

        # A stream on each provider (each has one slot): node-a's ends first (3 s), node-b's
        # later (5 s); the work queued behind them would go to node-a first, undrained.
        stream_a = asyncio.create_task(faults.stream_chat(http, api, body(150), 60))
        await until(busy(A))
        stream_b = asyncio.create_task(faults.stream_chat(http, api, body(250), 60))
        await until(busy(B))
        queued = [asyncio.create_task(faults.stream_chat(http, api, body(3), 60)) for _ in range(3)]

        async def waiting() -> bool:
            async with http.get(api.replace("/v1", "/iop/v1/catalog/models")) as response:
                return next(m for m in (await response.json())["data"])["queued"] == 3

        await until(waiting)
        out = await ctl(fleet, "drain", "node-a", "--reason", "reboot")
        assert "serving -> draining" in out, out
        draining = await providers(http, api)
        assert draining[A]["control"]["state"] == "draining", draining[A]
        assert draining[A]["control"]["in_flight"] == 1
        assert not stream_a.done()
        outcomes = await asyncio.gather(stream_a, stream_b, *queued)
        assert [o.kind for o in outcomes] == ["completed"] * 5, outcomes
        assert (await providers(http, api))[A]["control"]["state"] == "drained"
        table = await ctl(fleet, "providers")
        [line] = [line for line in table.splitlines() if line.startswith(A)]
        assert "drained" in line, table
        assert "0/1" in line, table  # its capacity once enabled, not the 0/0 it holds now
        report("iopctl providers, after the drain:\n" + table)
        more = [faults.stream_chat(http, fleet.apis[1], body(2), 60) for _ in range(2)]
        assert [o.kind for o in await asyncio.gather(*more)] == ["completed"] * 2

        await until(lambda: logged(http, fleet, since, 7))
        served = await runs_since(http, fleet, since)
        on_a = [r for r in served if any(a["provider_id"] == A for a in r["attempts"])]
        report(
            f"drain: {len(served)} runs, {len(on_a)} on the drained provider (the stream it"
            f" had), the 3 queued and 2 later ones on {B}"
        )
        assert len(on_a) == 1, on_a
        assert on_a[0]["outcome"] == "completed", on_a
        assert len(on_a[0]["attempts"]) == 1  # the stream on node-a, nothing after it
        await ctl(fleet, "enable", "node-a")


async def test_the_audit_trail_a_revert_and_a_control_plane_restart(
    fleet: SimpleNamespace, report: Any
) -> None:
    stack = fleet.stack
    headers = {"Authorization": f"Bearer {fleet.operator}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        before = json.loads(await ctl(fleet, "controls", "--json"))
        await ctl(fleet, "prefer", MODEL, f"{B},{A}", "--reason", "b is faster")
        since = int(time.time() * 1000)
        async with http.post(f"{fleet.apis[1]}/chat/completions", json=body(2)) as response:
            assert response.status == 200, await response.text()
        # both idle, a tie the fleet order gives node-a: the preference gives node-b
        await until(lambda: logged(http, fleet, since, 1))
        assert [r["provider_id"] for r in await runs_since(http, fleet, since)] == [B]
        out = await ctl(fleet, "drain", f"node-a/{A}", "--reason", "upgrade")
        drain_id = out.split(":", 1)[0]
        listing = json.loads(await ctl(fleet, "controls", "--audit", "--json"))
        kinds = {(c["kind"], c["target"], c["value"]) for c in listing["controls"]}
        assert kinds == {("prefer", MODEL, f"{B},{A}"), ("state", f"node-a/{A}", "draining")}
        newest = listing["audit"][0]
        assert newest["change_id"] == drain_id
        assert (newest["before"], newest["after"], newest["reason"]) == ("", "draining", "upgrade")
        assert newest["changed_by"].startswith("ops (")
        assert newest["at_ms"] > 0
        assert len(listing["audit"]) == len(before["audit"]) + 2
        table = await ctl(fleet, "controls", "--audit")
        report(
            "iopctl controls:\n"
            + await ctl(fleet, "controls")
            + "iopctl controls --audit:\n"
            + table
        )
        assert drain_id in table
        assert "draining" in table

        # the control-plane restarts: the controls are still in force, and still pushed
        assert await stack.stop("control-plane") == 0
        await stack.start("control-plane")

        async def answered() -> bool:
            """Both edges' control-plane links are back (a listing is asked of it)."""
            for api in fleet.apis:
                async with http.get(api.replace("/v1", "/iop/v1/controls")) as response:
                    if response.status != 200:
                        return False
            return True

        await until(answered, 30)
        after = json.loads(await ctl(fleet, "controls", "--json", api=fleet.apis[1]))
        assert {(c["kind"], c["target"], c["value"]) for c in after["controls"]} == kinds
        async with http.get(fleet.apis[1].replace("/v1", "/iop/v1/catalog/models")) as response:
            [model] = (await response.json())["data"]
        assert model["preference"] == [B, A]

        out = await ctl(fleet, "revert", drain_id, api=fleet.apis[1])
        report(f"iopctl revert {drain_id}:\n{out}")
        assert f"(reverts {drain_id})" in out, out
        assert "draining -> serving" in out, out
        await until(
            lambda: on_every_edge(
                http, fleet, lambda rows: rows[A]["control"]["state"] == "serving"
            )
        )
        listing = json.loads(await ctl(fleet, "controls", "--audit", "--json"))
        assert listing["audit"][0]["reverts"] == drain_id
        assert {(c["kind"], c["value"]) for c in listing["controls"]} == {("prefer", f"{B},{A}")}
        await ctl(fleet, "prefer", MODEL, "--clear")
