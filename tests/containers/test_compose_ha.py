"""docker-compose.yml's `ha` profile for real: PostgreSQL, two edges, HAProxy, nodes on both.

One throwaway compose project runs the default stack and the profile: iop-postgres (Debian's
PostgreSQL 15 on the project's base) and iop-haproxy (Debian's HAProxy), both of `make
images`, no registry; edge-1 and edge-2 on that PostgreSQL, HAProxy in front of their APIs,
published on the loopback. node-a is given the plain edge alone and dials the two others
from the control-plane's list. The tests speak to HAProxy with a key the control-plane
issued, and to each edge on its own from inside its container (their APIs are published
only through HAProxy). Order matters: the edge kill is last.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from compose_helpers import (
    READY_WITHIN_S,
    chat,
    compose,
    compose_project,
    docker,
    issue_key,
    wait_until_healthy,
)
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

DEFAULT_SERVICES = {"iop-init", "control-plane", "edge", "node-a", "worker", "llamacpp"}
HA_SERVICES = DEFAULT_SERVICES | {"postgres", "edge-1", "edge-2", "haproxy"}
EDGES = ("edge-1", "edge-2")
MODEL, PROVIDER = "mock-small", "node-a-mock"
# The load across the kill: a few clients at once, each request ~0.2 s (the mock's 50
# tokens/s), so a good part of them is in flight at any moment.
LOAD_TOTAL, LOAD_CLIENTS, KILL_AFTER = 160, 4, 30
REQUEST_DEADLINE_S = 120.0  # far beyond a request's time, and HAProxy's 2 s to see a death
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}

# Run inside an edge's container (python there, no curl): one request to that edge's own
# API; prints the status, then the body. argv: method, path, key, JSON body or "".
IN_EDGE = """
import sys, urllib.error, urllib.request
method, path, key, body = sys.argv[1:5]
request = urllib.request.Request("http://127.0.0.1:8080" + path, data=body.encode() or None,
    method=method, headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=60) as response:
        print(response.status); print(response.read().decode())
except urllib.error.HTTPError as error:
    print(error.code); print(error.read().decode())
"""


@dataclass(frozen=True)
class Ha:
    project: Any
    api: str  # HAProxy's, on the loopback
    key: str


def on_edge(ha: Ha, edge: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request to `edge` alone, from inside its container: (status, JSON body)."""
    payload = "" if body is None else json.dumps(body)
    out = compose(
        ha.project, "exec", "-T", edge, "python", "-c", IN_EDGE, method, path, ha.key, payload
    )
    status, _, text = out.decode().partition("\n")
    return int(status), json.loads(text)


def providers_on(ha: Ha, edge: str) -> dict[str, str]:
    status, body = on_edge(ha, edge, "GET", "/iop/v1/catalog/providers")
    return {row["provider_id"]: row["health"] for row in body["data"]} if status == 200 else {}


def wait_until_both_edges_see_the_node(ha: Ha) -> dict[str, dict[str, str]]:
    """Each edge's catalog, polled (its explicit signal) until PROVIDER is available on both:
    node-a, given the plain edge alone, learnt edge-1 and edge-2 from the control-plane's
    list and dialled them."""
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        seen = {edge: providers_on(ha, edge) for edge in EDGES}
        if all(health.get(PROVIDER) == "available" for health in seen.values()):
            return seen
        assert time.monotonic() < deadline, f"{PROVIDER} not available on both edges: {seen}"
        time.sleep(2)


def subprocess_fails(*command: str) -> bool:
    return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode != 0


@pytest.fixture(scope="module")
def ha(docker_compose: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ha]:
    for image in ("iop-postgres", "iop-haproxy"):
        if subprocess_fails(docker_compose, "image", "inspect", f"{image}:latest"):
            pytest.fail(f"{image} is not built (`make images`)")
    env = {"EDGE_PUBLISH_ADDRESS": "127.0.0.1", "LLAMACPP_THREADS": "1"}
    work = tmp_path_factory.mktemp("ha")
    with compose_project(["docker-compose.yml"], ROOT, env, work, profiles=["ha"]) as project:
        wait_until_healthy(project, HA_SERVICES)
        api = f"http://127.0.0.1:{project.get_service_port('haproxy', 8080)}"
        ha = Ha(project, api, issue_key(project))
        wait_until_both_edges_see_the_node(ha)
        yield ha


def test_the_profile_runs_postgres_two_edges_and_haproxy_from_local_images(ha: Ha) -> None:
    containers = {c.Service: c for c in ha.project.get_containers(include_all=True)}
    assert set(containers) == HA_SERVICES
    for service, image in (("postgres", "iop-postgres"), ("haproxy", "iop-haproxy")):
        used = docker("inspect", "--format", "{{.Config.Image}}", str(containers[service].ID))
        assert used.strip() == f"{image}:latest"
    # Each edge's shared store is the postgres service: its migrations ran there.
    tables = (
        compose(
            ha.project,
            "exec",
            "-T",
            "postgres",
            "psql",
            "-X",
            "-A",
            "-t",
            "-h",
            "127.0.0.1",
            "-U",
            "iop",
            "-d",
            "iop",
            "-c",
            "SELECT tablename FROM pg_tables ORDER BY 1",
        )
        .decode()
        .split()
    )
    assert {"edge_responses", "edge_file_contents"} <= set(tables), tables


def test_a_completion_through_haproxy_and_both_edges_see_the_node(ha: Ha) -> None:
    seen = wait_until_both_edges_see_the_node(ha)
    assert {edge: health[PROVIDER] for edge, health in seen.items()} == dict.fromkeys(
        EDGES, "available"
    )
    run = chat(ha.api, ha.key, MODEL)  # the run it reads back is on whichever edge served
    assert (run["model"], run["outcome"]) == (MODEL, "completed")


def test_what_one_edge_stores_the_other_reads(ha: Ha) -> None:
    """A stored response made on edge-1 is read, and continued, on edge-2; a file uploaded
    through HAProxy (whichever edge took it) is read from each edge: one shared store."""
    status, made = on_edge(ha, "edge-1", "POST", "/v1/responses", {"model": MODEL, "input": "hi"})
    assert status == 200, made
    status, read = on_edge(ha, "edge-2", "GET", f"/v1/responses/{made['id']}")
    assert (status, read["id"], read["status"]) == (200, made["id"], "completed")
    follow = {"model": MODEL, "input": "again", "previous_response_id": made["id"]}
    status, continued = on_edge(ha, "edge-2", "POST", "/v1/responses", follow)
    assert (status, continued["previous_response_id"]) == (200, made["id"]), continued

    client = OpenAI(base_url=f"{ha.api}/v1", api_key=ha.key, max_retries=0, timeout=60)
    content = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    client.close()
    for edge in EDGES:
        status, meta = on_edge(ha, edge, "GET", f"/v1/files/{uploaded.id}")
        assert (edge, status, meta["bytes"]) == (edge, 200, len(content))


def test_postgres_keeps_its_data_in_its_volume(ha: Ha) -> None:
    """The postgres container stopped, removed and made again: what the edges stored is still
    there, read from each edge, because the cluster lives in the postgres-data volume."""
    status, made = on_edge(ha, "edge-1", "POST", "/v1/responses", {"model": MODEL, "input": "keep"})
    assert status == 200, made
    container = ha.project.get_container("postgres").ID
    mounts = json.loads(docker("inspect", "--format", "{{json .Mounts}}", str(container)))
    volume = next(m for m in mounts if m["Destination"] == "/var/lib/postgresql/data")
    assert (volume["Type"], volume["Name"].rsplit("_", 1)[-1]) == ("volume", "postgres-data")
    compose(ha.project, "rm", "--stop", "--force", "postgres")
    compose(ha.project, "up", "--detach", "--no-deps", "--wait", "postgres")
    assert container != ha.project.get_container("postgres").ID  # a new container
    version = compose(
        ha.project, "exec", "-T", "postgres", "cat", "/var/lib/postgresql/data/PG_VERSION"
    )
    assert version.decode().strip() == "15"
    for edge in EDGES:  # each edge's pool reconnects; a retryable 503 until it has
        deadline = time.monotonic() + READY_WITHIN_S
        while True:
            status, read = on_edge(ha, edge, "GET", f"/v1/responses/{made['id']}")
            if status != 503:
                break
            assert read["error"]["code"] == "storage_unavailable", read
            assert time.monotonic() < deadline, read
            time.sleep(1)
        assert (edge, status, read["id"]) == (edge, 200, made["id"]), read


@dataclass
class Sent:
    started: float
    ended: float = 0.0
    kind: str = ""  # completed | error (an OpenAI error object) | cut (connection ended) | lost
    detail: str = ""


@dataclass
class Load:
    api: str
    key: str
    sent: list[Sent] = field(default_factory=list)
    done: int = 0

    async def run(self) -> None:
        queue = iter(range(LOAD_TOTAL))
        connector = aiohttp.TCPConnector(force_close=True)  # a connection per request
        headers = {"Authorization": f"Bearer {self.key}"}
        async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
            await asyncio.gather(*(self.client(http, queue) for _ in range(LOAD_CLIENTS)))

    async def client(self, http: aiohttp.ClientSession, queue: Iterator[int]) -> None:
        for _ in queue:
            record = Sent(time.monotonic())
            self.sent.append(record)
            record.kind, record.detail = await self.one(http)
            record.ended = time.monotonic()
            self.done += 1

    async def one(self, http: aiohttp.ClientSession) -> tuple[str, str]:
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                async with http.post(f"{self.api}/v1/chat/completions", json=BODY) as response:
                    payload = await response.json()
        except TimeoutError:
            return "lost", "no answer within the deadline"
        except aiohttp.ContentTypeError as exc:
            return "lost", f"{exc.status}: not JSON"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return "cut", type(exc).__name__  # the client was told: the connection ended
        if response.status == 200 and payload["choices"][0]["finish_reason"]:
            return "completed", ""
        if "error" in payload:
            return "error", f"{response.status} {payload['error'].get('code')}"
        return "lost", f"{response.status}: {payload}"

    def counts(self) -> dict[str, int]:
        kinds = [s.kind for s in self.sent]
        return {
            "sent": len(kinds),
            "completed": kinds.count("completed"),
            "failed": kinds.count("error") + kinds.count("cut"),
            "lost": kinds.count("lost"),
        }


HAPROXY_STATS = """
import csv, io, sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:8404/stats;csv", timeout=10) as response:
    rows = csv.DictReader(io.StringIO(response.read().decode().lstrip("# ")))
    print([row["status"] for row in rows if row["svname"] == sys.argv[1]][0])
"""


def haproxy_status(ha: Ha, edge: str) -> str:
    """What HAProxy thinks of `edge` now (UP, DOWN, ...), from its stats in its container."""
    out = compose(ha.project, "exec", "-T", "haproxy", "python3", "-c", HAPROXY_STATS, edge)
    return out.decode().strip()


@dataclass
class Kill:
    killing: float  # `docker kill` called
    dead: float  # `docker kill` returned: the container is not running
    down: float  # HAProxy's stats first read DOWN for it


async def load_across_a_kill(ha: Ha, edge: str) -> tuple[Load, Kill]:
    """LOAD_TOTAL requests through HAProxy; `docker kill` of `edge` after KILL_AFTER ended,
    and HAProxy's stats polled until they show it down, while the load runs on."""
    load = Load(ha.api, ha.key)
    running = asyncio.create_task(load.run())
    async with asyncio.timeout(READY_WITHIN_S):
        while load.done < KILL_AFTER:  # noqa: ASYNC110 - progress of the clients' tasks
            await asyncio.sleep(0.05)
    assert await asyncio.to_thread(haproxy_status, ha, edge) == "UP"
    container = str(ha.project.get_container(edge).ID)
    killing = time.monotonic()
    await asyncio.to_thread(docker, "kill", container)  # SIGKILL, returns once it is dead
    dead = time.monotonic()
    async with asyncio.timeout(READY_WITHIN_S):
        while not (await asyncio.to_thread(haproxy_status, ha, edge)).startswith("DOWN"):
            pass  # each read is a `docker compose exec`: no tighter loop than that
    down = time.monotonic()
    await running
    return load, Kill(killing, dead, down)


def test_an_edge_killed_under_load_loses_no_request(ha: Ha) -> None:
    """edge-1 is SIGKILLed (`docker kill`) under a small load through HAProxy: every request
    completes or ends with one clear error (an OpenAI error, or its connection cut), none is
    lost; only requests sent before HAProxy marked the edge down may fail (those it carried,
    and those dispatched to it in the seconds its health check takes to see a dead
    container, which answers nothing), every one sent after completes; what the dead edge
    stored is read through HAProxy from the edge left. Last in the file: it kills edge-1."""
    status, made = on_edge(ha, "edge-1", "POST", "/v1/responses", {"model": MODEL, "input": "hi"})
    assert status == 200, made
    load, kill = asyncio.run(load_across_a_kill(ha, "edge-1"))
    counts = load.counts()
    in_flight = [s for s in load.sent if s.started < kill.dead and s.ended > kill.killing]
    before_down = [s for s in load.sent if kill.dead <= s.started < kill.down]
    after = [s for s in load.sent if s.started >= kill.down]
    failed = [s for s in load.sent if s.kind != "completed"]
    print(
        f"edge-1 killed under load through HAProxy: {counts}; in flight at the kill "
        f"{len(in_flight)}, sent before HAProxy marked it down {len(before_down)} "
        f"({kill.down - kill.dead:.1f} s), sent after {len(after)}; failed: in flight "
        f"{sum(s.kind != 'completed' for s in in_flight)}, before down "
        f"{sum(s.kind != 'completed' for s in before_down)}, after "
        f"{sum(s.kind != 'completed' for s in after)}; errors: {sorted({s.detail for s in failed})}"
    )
    assert counts["sent"] == LOAD_TOTAL
    assert counts["lost"] == 0, [(s.kind, s.detail) for s in failed]
    assert in_flight, "the kill landed while no request was running: nothing was tested"
    assert after, "no request was sent after HAProxy saw the edge down"
    assert all(s.kind == "completed" for s in after), [(s.kind, s.detail) for s in after]
    # What edge-1 stored before it died, read through HAProxy: only edge-2 answers now.
    client = OpenAI(base_url=f"{ha.api}/v1", api_key=ha.key, max_retries=0, timeout=60)
    try:
        assert client.responses.retrieve(made["id"]).id == made["id"]
    finally:
        client.close()
