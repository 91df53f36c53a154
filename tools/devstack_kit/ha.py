"""``make run HA=1``: the stack with its edge tier doubled (docs/ARCHITECTURE.md, "Running
several edges").

A PostgreSQL server (``tools/postgres_server.py``) the two edges share, the first edge
and a second one (``edge-b``, its own certificate, admin, HTTP and node-listener ports,
the same control-plane), and ``tools/tcp_balancer.py`` on the usual public port 8080 in
front of the edges' HTTP ports (8081, 8082), so clients see one API. node-a and the
worker dial the first edge, node-b the second: each edge has a node from the start, and
every node and worker learns the other edge from the control-plane's list of edges and
dials it too. The order is the start order: PostgreSQL before the edges that open their
pool on it, the balancer last, once there is something behind it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .plan import HOST, Plan, ServiceSpec

PUBLIC_PORT = 8080  # where `make run` serves the API; with HA the balancer takes it
POSTGRES_PORT = 5432
EDGE_HTTP = {"edge": 8081, "edge-b": 8082}
EDGE_NODES = {"edge": 7000, "edge-b": 7001}
EDGE_B_ADMIN = 9105
DSN = "postgresql://iop@{host}:{POSTGRES_PORT}/iop"  # as postgres_server.py creates it

POSTGRES = ServiceSpec(
    "postgres",
    "tools/postgres_server.py",
    None,
    POSTGRES_PORT,
    tls=False,
    argv=(
        "{python}",
        "{script}",
        *("--host", "{host}", "--port", "{port}", "--data", "{state}/postgres/data"),
    ),
    port_role="PostgreSQL",
    scheme="postgresql",
    ready_timeout_s=90.0,  # initdb on the first start
)

BALANCER = ServiceSpec(
    "balancer",
    "tools/tcp_balancer.py",
    None,
    PUBLIC_PORT,
    tls=False,
    health_path="/iop/v1/catalog/models",  # answered by an edge behind it
    dials={"EDGE_HTTP": EDGE_HTTP["edge"], "EDGE_B_HTTP": EDGE_HTTP["edge-b"]},
    argv=(
        "{python}",
        "{script}",
        *("--listen", "{host}:{port}"),
        *("--backend", "{host}:{EDGE_HTTP}", "--backend", "{host}:{EDGE_B_HTTP}"),
    ),
    port_role="API",
    public_api=True,
)


def edge_spec(edge: ServiceSpec, name: str, admin_port: int) -> ServiceSpec:
    """``edge`` as ``name``: its own ports and local files, the shared store's DSN."""
    state = {env: f"{name}-{file.removeprefix('edge-')}" for env, file in edge.state.items()}
    return dataclasses.replace(
        edge,
        name=name,
        admin_port=admin_port,
        ports={"IOP_HTTP__PORT": EDGE_HTTP[name], "IOP_NODE_LISTENER__PORT": EDGE_NODES[name]},
        state=state if name != "edge" else edge.state,
        dials={**edge.dials, "POSTGRES_PORT": POSTGRES_PORT},
        env_templates={"IOP_SERVICE_ID": name, "IOP_POSTGRES__DSN": DSN},
    )


def ha_services(base: Sequence[ServiceSpec]) -> tuple[ServiceSpec, ...]:
    """``base`` (``make run``'s processes, with vLLM or not) made highly available."""
    by_name = {spec.name: spec for spec in base}
    edge = by_name["edge"]
    chosen: list[ServiceSpec] = []
    for spec in base:
        if spec.name == "control-plane":
            chosen += [POSTGRES, spec]
        elif spec.name == "edge":
            chosen += [edge_spec(edge, "edge", edge.admin_port)]
            chosen += [edge_spec(edge, "edge-b", EDGE_B_ADMIN)]
        elif spec.name == "node-b":  # the second edge's first node
            port = EDGE_NODES["edge-b"]
            chosen += [dataclasses.replace(spec, dials={**spec.dials, "IOP_EDGE__PORT": port})]
        else:
            chosen.append(spec)
    return (*chosen, BALANCER)


def ha_line(plans: Sequence[Plan]) -> str | None:
    """What runs where behind the balancer (``None`` without one): each edge's API and node
    listener, and the store they share, for the line after ``ports:``."""
    edges = [p for p in plans if "IOP_POSTGRES__DSN" in p.env]
    if not edges or not any(p.spec.public_api for p in plans):
        return None
    where = ", ".join(
        f"{p.name} API http://{HOST}:{p.env['IOP_HTTP__PORT']} "
        f"(nodes and workers dial {HOST}:{p.env['IOP_NODE_LISTENER__PORT']})"
        for p in edges
    )
    return f"behind the balancer: {where}; their shared store {edges[0].env['IOP_POSTGRES__DSN']}"
