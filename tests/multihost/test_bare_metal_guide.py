"""docs/deploy-bare-metal.md, followed on four hosts: each step is the guide's own commands.

The hosts are network namespaces on one bridge (``netns``); ``guide`` runs the blocks the
guide marks, on the host each names. The tests run in the guide's order and share one
fleet: first completion (a client on host 1 -> the edge -> node-a on host 2 -> a real
llama.cpp), node-b added on host 3 while it runs, its provider's served name changed (the
catalog follows), node-b retired, host 2's link cut without a word (node-a's provider
leaves selection within the failure-detection bound), then the last section: a second
edge on host 2, both edges on host 4's PostgreSQL behind its HAProxy, and host 1's edge
SIGKILLed under load through the balancer.

What the test itself looks at (the catalog, the run log, tokens) it reads from host 1,
the only place an operator could: addresses exist only between the namespaces (host 3
stands for a client elsewhere once the balancer is up).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509
from edge_tier import LOAD_TOTAL, MODEL, PROVIDER, connections, issued_key, load
from guide import Guide
from hostapi import available, catalog, chat, control_plane_cli, eventually, http, node_list, record
from netns import SUBNET, Network

from iop_proto.testing import running_service

pytestmark = pytest.mark.asyncio(loop_scope="module")

# docs/api.md "Failure detection": heartbeats every 2 s, a peer silent for 3 of them is dead.
HEARTBEAT_DEADLINE_S = 6.0
# What the test's own look adds to the measured moment: one poll, and starting a process
# in the namespace to make it.
MEASURE_SLACK_S = 1.0
# The figures for the way before this guide (docs only, three hosts, a fast reader).
BEFORE_STEPS, BEFORE_SECONDS = 24, 210


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guide(network: Network) -> AsyncIterator[Guide]:
    # Outside pytest's root-only temporary tree: host 4's PostgreSQL runs as the postgres
    # account, which must reach its cluster's directories there.
    base = Path(tempfile.mkdtemp(prefix="iop-multihost-"))
    os.chmod(base, 0o711)
    running = Guide(network, base, dict(os.environ))
    try:
        yield running
    finally:
        await running.close()
        shutil.rmtree(base, ignore_errors=True)


async def test_first_completion_on_three_hosts_following_the_guide(guide: Guide) -> None:
    host1 = guide.network.host(1)
    started = time.monotonic()
    await guide.run("first")
    await eventually(available(host1, "smollm2:135m", "node-a-llamacpp"), 60)
    printed = await guide.run("first-completion")
    took_s = time.monotonic() - started
    listing, answer = printed.rsplit("\n", 1)[0], json.loads(printed.strip().splitlines()[-1])
    assert "node-a" in listing
    assert answer["model"] == "smollm2:135m"
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0
    # It was node-a's llama.cpp, on host 2, that answered.
    status, runs = await http(host1, "GET", "/iop/v1/runs")
    assert status == 200
    assert runs["data"][0]["provider_id"] == "node-a-llamacpp"
    assert runs["data"][0]["outcome"] == "completed"
    # and `node list` on host 1 says it is connected.
    seen: list[object] = []

    async def connected() -> bool:
        nodes = {n["node_id"]: n for n in json.loads(await guide.shell(1, node_list(guide)))}
        seen[:] = [nodes.get("node-a")]
        return (nodes.get("node-a") or {}).get("state") == "connected"

    await eventually(connected, 30, seen)
    # from host 2's address, as the edge saw the connection come
    (node_a,) = seen
    assert isinstance(node_a, dict)
    assert node_a["peer_address"].startswith(f"{guide.network.host(2).address}:"), node_a
    record(
        {
            "before": {"manual_steps": BEFORE_STEPS, "seconds": BEFORE_SECONDS},
            "after": {
                "manual_steps": guide.manual_commands("first", "first-completion"),
                "manual_steps_without_the_install": guide.manual_commands(
                    "first", "first-completion", installs=False
                ),
                "seconds_run_by_the_test": round(took_s, 1),
                "seconds_of_the_setup_commands": round(guide.durations["first"], 1),
            },
        }
    )


async def test_the_worker_joins_the_edge(guide: Guide) -> None:
    await guide.run("worker")
    await guide.services[(1, "iop-edge")].wait_for_line("worker worker registered")


async def test_a_node_added_at_runtime_serves(guide: Guide) -> None:
    host1 = guide.network.host(1)
    await guide.run("add-node")
    # Host 3's settings are the file `node add` wrote on host 1, copied as they were.
    written = guide.files(1).root / "etc/iop/tokens/node-b.yaml"
    assert "service_id: node-b" in written.read_text()
    await eventually(available(host1, "mock-small", "node-b-mock"), 30)
    status, answer = await chat(host1, "mock-small")
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"]
    # node-a was not touched: still there.
    assert await available(host1, "smollm2:135m", "node-a-llamacpp")()


async def test_a_changed_served_name_reaches_the_catalog(guide: Guide) -> None:
    host1 = guide.network.host(1)

    async def renamed() -> bool:
        provider = (await catalog(host1, "providers")).get("node-b-mock")
        model = (await catalog(host1, "models")).get("mock-small")
        return (
            provider is not None
            and provider["models"] == ["mock-small-v2"]
            and model is not None
            and model["providers"] == {"node-b-mock": "mock-small-v2"}
            and "node-b-mock" in model["available_providers"]
        )

    await guide.run("models")
    await eventually(renamed, 30)
    status, answer = await chat(host1, "mock-small")
    assert status == 200, answer


async def test_a_retired_node_leaves_the_catalog_and_its_token_is_revoked(guide: Guide) -> None:
    host1 = guide.network.host(1)

    seen: list[object] = []

    async def forgotten() -> bool:
        providers = await catalog(host1, "providers")
        model = (await catalog(host1, "models")).get("mock-small")
        seen[:] = [sorted(providers), model]
        return "node-b-mock" not in providers and (model is None or model["providers"] == {})

    # `node retire` alone, the fleet file still naming node-b: out at once.
    printed = await guide.run("retire")
    assert "Retired node 'node-b'" in printed
    assert "Models left with no provider: mock-small." in printed
    await eventually(forgotten, 10, seen)
    model = (await catalog(host1, "models"))["mock-small"]
    assert model["available"] is False
    assert "no provider serves it" in model["unavailable_reason"]
    listed = await guide.shell(1, control_plane_cli(guide, "token", "list", "--json"))
    tokens = [t for t in json.loads(listed) if t["node_id"] == "node-b"]
    assert tokens
    assert all(t["revoked_at"] for t in tokens)
    status, answer = await chat(host1, "mock-small")
    assert status == 503, answer
    # node-b, still running on host 3, dials again and is refused: it stays out.
    edge = guide.services[(1, "iop-edge")]
    await edge.wait_for_line("node node-b: retired, disconnecting it")
    await edge.wait_for_line("refused node node-b at registration (node_retired)")
    # and the node's own log says so, with what admits it again
    line = await guide.services[(3, "iop-node")].wait_for_line("the edge refused")
    assert "node 'node-b' is retired" in line
    assert "node add node-b" in line
    assert await forgotten()

    await guide.run("retire-cleanup")
    assert guide.exits[(3, "iop-node")] == 0  # stopped by the guide's systemctl, cleanly
    models = await catalog(host1, "models")
    assert "mock-small" not in models
    status, answer = await chat(host1, "mock-small")
    assert status == 404, answer
    assert await available(host1, "smollm2:135m", "node-a-llamacpp")()


async def test_a_node_dialling_an_address_the_edge_certificate_lacks_stops_with_exit_2(
    guide: Guide, tmp_path: Path
) -> None:
    """The mistake the issue began with, on real addresses: the exit code the units do not
    restart on (RestartPreventExitStatus=2), and a line naming the fix."""
    other = f"{SUBNET}.101"  # host 1 again, by an address its certificate does not carry
    guide.network.add_address(1, other)
    settings = guide.files(2).root / "etc/iop/node.yaml"  # node-a's, as the guide wrote it
    env = {
        "IOP_EDGE__HOST": other,
        "IOP_ADMIN__PORT": "0",
        "IOP_HISTORY_DB": str(tmp_path / "history.db"),
    }
    host2 = guide.network.host(2)
    async with running_service("iop-node", settings, env=env, wrapper=host2.wrapper) as node:
        code = await asyncio.wait_for(node.process.wait(), 30)
    log = "".join(node.log)
    assert code == 2, log
    assert f"devcerts --san edge=IP:{other}" in log
    # The real node-a, beside it on host 2, is still serving.
    assert await available(guide.network.host(1), "smollm2:135m", "node-a-llamacpp")()


async def test_a_silently_cut_link_takes_the_nodes_provider_out_within_the_bound(
    guide: Guide,
) -> None:
    host1 = guide.network.host(1)
    model, provider = "smollm2:135m", "node-a-llamacpp"
    assert await available(host1, model, provider)()
    guide.network.cut(2)
    cut_at = time.monotonic()

    async def out() -> bool:
        return not await available(host1, model, provider)()

    await eventually(out, HEARTBEAT_DEADLINE_S + 10)
    detected_s = time.monotonic() - cut_at
    record({"link_cut_out_of_selection_s": round(detected_s, 2)})
    assert detected_s <= HEARTBEAT_DEADLINE_S + MEASURE_SLACK_S
    # Found by the silence (no FIN, no RST crossed the cut), not by a closed connection.
    edge = guide.services[(1, "iop-edge")]
    await edge.wait_for_line("node node-a disconnected: no frame from node-a")
    # With its only provider gone, a request is told so at once rather than left waiting.
    status, answer = await chat(host1, model)
    assert status == 503, answer


async def test_the_edge_reissued_with_another_name_takes_its_nodes_back(guide: Guide) -> None:
    host1 = guide.network.host(1)
    guide.network.mend(2)
    await guide.run("reissue")
    pem = (guide.files(1).root / "etc/iop/certs/edge.pem").read_bytes()
    names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert "iop-edge.example" in names.value.get_values_for_type(x509.DNSName)
    # node-a, its link back, dials the restarted edge (with its new certificate) again.
    await eventually(available(host1, "smollm2:135m", "node-a-llamacpp"), 40)
    status, answer = await chat(host1, "smollm2:135m")
    assert status == 200, answer


# --- Two edge hosts and one PostgreSQL host ----------------------------------------------

KILL_AFTER = 20  # requests ended before host 1's edge is killed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients_key(guide: Guide) -> str:
    """The guide's last section, run: both edges on host 4's PostgreSQL behind its HAProxy;
    the API key it issued for clients."""
    guide.network.mend(2)  # whatever the tests before left cut
    key = issued_key(await guide.run("ha"))
    for number in (1, 2):  # node-a, told of edge-2 by the control-plane, dialled it too
        await eventually(available(guide.network.host(number), MODEL, PROVIDER, key), 60)
    # HAProxy sends to an edge once its checks pass (rise 2, a second apart), which an
    # edge that just started may not have yet: until it has served through each.
    host3, balancer = guide.network.host(3), guide.network.host(4).address

    async def both_served() -> bool:
        await chat(host3, MODEL, to=balancer, key=key)
        return {"edge-1", "edge-2"} <= {c.edge for c in connections(guide.haproxy_log(4))}

    await eventually(both_served, 30, guide)
    return key


async def test_two_edges_on_one_postgresql_following_the_guide(
    guide: Guide, clients_key: str
) -> None:
    host3, balancer = guide.network.host(3), guide.network.host(4).address
    for number in (1, 2):
        edge = guide.services[(number, "iop-edge")]
        await edge.wait_for_line("shared store: PostgreSQL")
    # The worker, given host 1's edge only, learnt of edge-2 and joined it too.
    await guide.services[(2, "iop-edge")].wait_for_line("worker worker registered")
    # A client on host 3 reaches the pool through host 4, with the key; without it, refused.
    status, answer = await chat(host3, MODEL, to=balancer, key=clients_key)
    assert status == 200, (answer, guide.haproxy_log(4))
    assert answer["choices"][0]["message"]["content"]
    status, answer = await chat(host3, MODEL, to=balancer)
    assert status == 401, answer
    record(
        {
            "edge_tier": {
                "manual_steps": guide.manual_commands("ha"),
                "manual_steps_without_the_install": guide.manual_commands("ha", installs=False),
                "seconds_of_the_setup_commands": round(guide.durations["ha"], 1),
            }
        }
    )


async def test_an_edge_host_killed_under_load_through_the_balancer(
    guide: Guide, clients_key: str
) -> None:
    """Host 1's edge SIGKILLed while a client on host 3 sends through host 4: nothing is
    lost, only requests in flight at the kill may fail (each with a clear error), every
    request sent after it completes on edge-2; what edge 1 stored, edge-2 reads."""
    host1, host2, host3 = (guide.network.host(n) for n in (1, 2, 3))
    balancer = guide.network.host(4).address
    # Made on host 1's edge, before it dies: a stored response, and a file.
    status, first = await http(
        host1,
        "POST",
        "/v1/responses",
        {"model": MODEL, "input": "one", "max_output_tokens": 8},
        key=clients_key,
    )
    assert status == 200, first
    content = '{"n": 1}\n'
    upload = guide.files(1).root / "upload.jsonl"
    upload.write_text(content)
    uploaded = json.loads(
        await guide.shell(
            1,
            f"curl -sf -H 'Authorization: Bearer {clients_key}' -F purpose=batch "
            f"-F file=@{upload} http://127.0.0.1:8080/v1/files",
        )
    )

    moments: dict[str, float] = {}

    async def kill_when_due(ended: int) -> None:
        if ended == KILL_AFTER:
            moments["killing"] = time.monotonic()
            moments["code"] = await guide.kill(1, "iop-edge") or 0
            moments["dead"] = time.monotonic()

    logged_before = len(guide.haproxy_log(4))
    sent = await load(guide, clients_key, kill_when_due)
    carried = connections(guide.haproxy_log(4)[logged_before:])
    killing, dead = moments["killing"], moments["dead"]
    kinds = [s["kind"] for s in sent]
    counts = {
        "sent": len(sent),
        "completed": kinds.count("completed"),
        "failed": kinds.count("error") + kinds.count("cut"),
        "lost": kinds.count("lost"),
    }
    in_flight = [s for s in sent if s["started"] < dead and s["ended"] > killing]
    after = [s for s in sent if s["started"] > dead]
    failed = [s for s in sent if s["kind"] != "completed"]
    assert moments["code"] == -signal.SIGKILL
    assert counts["sent"] == LOAD_TOTAL
    assert counts["lost"] == 0, [s for s in sent if s["kind"] == "lost"]
    assert in_flight, "the kill landed while no request was running: nothing was tested"
    assert all(s in in_flight for s in failed), [s for s in failed if s not in in_flight]
    # and they are the ones HAProxy was carrying on the killed edge: cut before any answer.
    cut_on_edge_1 = [c for c in carried if c.edge == "edge-1" and c.answered_bytes == 0]
    assert len(failed) == len(cut_on_edge_1), (failed, carried)
    assert all(c.answered_bytes > 0 for c in carried if c.edge == "edge-2"), carried
    assert after, "no request was sent after the kill"
    assert all(s["kind"] == "completed" for s in after), [s for s in after if s not in failed]

    # What host 1's edge stored, read on edge-2 (host 2's own API) and through the balancer.
    readable: dict[str, int] = {}
    for where, host, to in (("edge-2", host2, "127.0.0.1"), ("balancer", host3, balancer)):
        status, _ = await http(host, "GET", f"/v1/responses/{first['id']}", to=to, key=clients_key)
        readable[f"response via {where}"] = status
    status, second = await http(
        host3,
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "input": "two",
            "previous_response_id": first["id"],
            "max_output_tokens": 8,
        },
        to=balancer,
        key=clients_key,
    )
    readable["chain continued via balancer"] = status
    assert status == 200, second
    status, items = await http(
        host2, "GET", f"/v1/responses/{second['id']}/input_items", key=clients_key
    )
    said = json.dumps(items)
    assert status == 200, items
    assert "one" in said, items  # the first turn, stored by the edge that died
    assert "two" in said, items
    stored = await guide.shell(
        2,
        f"curl -sf -H 'Authorization: Bearer {clients_key}' "
        f"http://127.0.0.1:8080/v1/files/{uploaded['id']}/content",
    )
    readable["file via edge-2"] = 200 if stored == content else 0
    record(
        {
            "edge_killed_under_load": {
                **counts,
                "in_flight_at_the_kill": len(in_flight),
                "sent_after_the_kill": len(after),
                "failed_outcomes": sorted({f"{s['kind']} {s['detail']}" for s in failed}),
                "cut_on_edge_1_by_haproxy_log": len(cut_on_edge_1),
                "carried_by": {
                    edge: sum(1 for c in carried if c.edge == edge) for edge in ("edge-1", "edge-2")
                },
                "refused_by_edge_1_and_redispatched": sum(1 for c in carried if c.redispatched),
                "made_on_edge_1_read_on_edge_2": readable,
            }
        }
    )
    assert set(readable.values()) == {200}, readable
