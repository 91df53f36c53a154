# ruff: noqa: E501 - PromQL queries read best on one line each
"""Writes IOP's Grafana dashboards, deploy/grafana/dashboards/*.json, from the panels below.

    .venv/bin/python tools/grafana_dashboards.py        # rewrite the JSON files
    .venv/bin/python tools/grafana_dashboards.py --check  # exit 1 if a file is not what it writes

The JSON is what Grafana loads (file provisioning, deploy/grafana/provisioning/); this file
is where a panel is added, so that every dashboard has the same layout, the same datasource
(uid ``iop-prometheus``, the provisioned one) and the same variables.
tests/e2e/test_observability.py runs every query against a real Prometheus scraping a stack.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "iop-prometheus"}
SCHEMA_VERSION = 39  # Grafana 10.4 / 11.x dashboards
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or stat, table
    width: int = 12
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[tuple[str, str], ...] = field(default=())  # (name, label_values query)


def _quantile(q: float, metric: str, by: str, matcher: str = "") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{matcher}[{RATE}])))"


MODEL = '{model=~"$model"}'
REQ = "iop_edge_requests_total"
ERRORS_5XX = (
    f'(sum by (model) (rate({REQ}{{model=~"$model",status=~"5.."}}[{RATE}]))'
    f" or sum by (model) (rate({REQ}{MODEL}[{RATE}])) * 0)"
    f" / sum by (model) (rate({REQ}{MODEL}[{RATE}]))"
)
MODEL_VAR = ("model", "label_values(iop_edge_requests_total, model)")

EDGE = Dashboard(
    "iop-edge",
    "IOP / Edge",
    "Requests, errors, latency and the edge's links, per model (docs/observability.md)",
    (
        Panel(
            "Requests/s by status",
            ((f"sum by (status) (rate({REQ}{MODEL}[{RATE}]))", "{{status}}"),),
            "reqps",
        ),
        Panel("5xx ratio by model", ((ERRORS_5XX, "{{model}}"),), "percentunit"),
        Panel(
            "Time to first token",
            (
                (
                    _quantile(0.5, "iop_edge_time_to_first_token_seconds", "model", MODEL),
                    "p50 {{model}}",
                ),
                (
                    _quantile(0.95, "iop_edge_time_to_first_token_seconds", "model", MODEL),
                    "p95 {{model}}",
                ),
            ),
            "s",
        ),
        Panel(
            "Request duration p95",
            ((_quantile(0.95, "iop_edge_request_duration_seconds", "model", MODEL), "{{model}}"),),
            "s",
        ),
        Panel(
            "Requests in flight",
            ((f"sum by (model) (iop_edge_requests_in_flight{MODEL})", "{{model}}"),),
        ),
        Panel(
            "Edge and node overhead p95 (x-iop-overhead-ms)",
            (
                (
                    _quantile(0.95, "iop_edge_overhead_seconds", "operation, stream"),
                    "{{operation}} stream={{stream}}",
                ),
            ),
            "s",
        ),
        Panel(
            "Tokens/s by model and kind",
            (
                (
                    f"sum by (model, kind) (rate(iop_edge_tokens_total{MODEL}[{RATE}]))",
                    "{{model}} {{kind}}",
                ),
            ),
        ),
        Panel(
            "Retries/s (runs reopened elsewhere) by failed provider",
            (
                (
                    f"sum by (provider) (rate(iop_edge_retries_total{MODEL}[{RATE}])) or vector(0)",
                    "{{provider}}",
                ),
            ),
        ),
        Panel(
            "Nodes connected",
            (("sum by (instance) (iop_edge_nodes_connected)", "{{instance}}"),),
            kind="stat",
            width=6,
        ),
        Panel(
            "Control-plane link",
            (("min by (instance) (iop_edge_control_plane_connected)", "{{instance}}"),),
            kind="stat",
            width=6,
        ),
        Panel(
            "Fleet config version (control-plane, edges)",
            (
                ("max(iop_control_plane_config_version)", "control-plane"),
                ("max by (instance) (iop_edge_config_version)", "{{instance}}"),
            ),
            kind="stat",
            width=6,
        ),
        Panel(
            "Peers refused on the node port",
            (
                (
                    "sum by (stage, reason) (increase(iop_edge_peer_refusals_total[1h])) or vector(0)",
                    "{{stage}} {{reason}}",
                ),
            ),
            kind="stat",
            width=6,
        ),
        Panel(
            "Open sockets by service",
            (("sum by (job, instance) (iop_open_sockets)", "{{job}} {{instance}}"),),
        ),
        Panel(
            "Asyncio tasks by service",
            (("sum by (job, instance) (iop_asyncio_tasks)", "{{job}} {{instance}}"),),
        ),
    ),
    (MODEL_VAR,),
)

PROVIDER = '{provider=~"$provider"}'
NODES = Dashboard(
    "iop-nodes",
    "IOP / Nodes & providers",
    "Each provider's health, load and runs, as the edge and its node see them",
    (
        Panel(
            "Providers available (edge's view; 0: down or disconnected)",
            (
                (
                    'max by (provider) (iop_edge_provider_health{provider=~"$provider",state="available"})',
                    "{{provider}}",
                ),
            ),
        ),
        Panel(
            "Ejected from selection",
            ((f"max by (provider) (iop_edge_provider_ejected{PROVIDER})", "{{provider}}"),),
        ),
        Panel(
            "In flight / capacity (node)",
            (
                (
                    f"sum by (provider) (iop_node_provider_in_flight{PROVIDER})",
                    "in flight {{provider}}",
                ),
                (
                    f"sum by (provider) (iop_node_provider_capacity{PROVIDER})",
                    "capacity {{provider}}",
                ),
            ),
        ),
        Panel(
            "Runs in flight (edge's view)",
            (
                (
                    f"sum by (provider, node) (iop_edge_provider_in_flight{PROVIDER})",
                    "{{provider}} on {{node}}",
                ),
            ),
        ),
        Panel(
            "Runs/s by outcome (node)",
            (
                (
                    f"sum by (provider, outcome) (rate(iop_node_runs_total{PROVIDER}[{RATE}]))",
                    "{{provider}} {{outcome}}",
                ),
            ),
            "ops",
        ),
        Panel(
            "Service time p95 (node)",
            ((_quantile(0.95, "iop_node_service_seconds", "provider", PROVIDER), "{{provider}}"),),
            "s",
        ),
        Panel(
            "Completion tokens/s (node)",
            (
                (
                    f'sum by (provider) (rate(iop_node_tokens_total{{provider=~"$provider",kind="completion"}}[{RATE}]))',
                    "{{provider}}",
                ),
            ),
        ),
        Panel(
            "Engine health (node's probes)",
            (
                (
                    f"max by (provider, state) (iop_node_provider_health{PROVIDER}) == 1",
                    "{{provider}} {{state}}",
                ),
            ),
            kind="table",
        ),
        Panel(
            "Ejections (last hour)",
            (
                (
                    f"sum by (provider) (increase(iop_edge_ejections_total{PROVIDER}[1h]))",
                    "{{provider}}",
                ),
            ),
            kind="stat",
            width=6,
        ),
        Panel(
            "Nodes registered with an edge",
            (("sum by (instance) (iop_node_edge_connected)", "{{instance}}"),),
            kind="stat",
            width=6,
        ),
        Panel(
            "Node registrations at the control-plane (last hour)",
            (
                (
                    "sum by (result) (increase(iop_control_plane_authorizations_total[1h]))",
                    "{{result}}",
                ),
            ),
            kind="stat",
            width=12,
        ),
    ),
    (("provider", "label_values(iop_edge_provider_health, provider)"),),
)

QUEUES = Dashboard(
    "iop-queues",
    "IOP / Queues",
    "Who waits where: the edge's model queues, the nodes' provider queues, and batch lines yielding",
    (
        Panel(
            "Waiting in the edge's queue, by model",
            ((f"sum by (model) (iop_edge_model_queued{MODEL})", "{{model}}"),),
        ),
        Panel(
            "Waiting in a node's queue, by provider",
            (("sum by (provider) (iop_node_provider_queued)", "{{provider}}"),),
        ),
        Panel(
            "Queue wait (edge + node) p50 / p95",
            (
                (_quantile(0.5, "iop_edge_queue_wait_seconds", "model", MODEL), "p50 {{model}}"),
                (_quantile(0.95, "iop_edge_queue_wait_seconds", "model", MODEL), "p95 {{model}}"),
            ),
            "s",
        ),
        Panel(
            "Node queue wait p95",
            ((_quantile(0.95, "iop_node_queue_wait_seconds", "provider"), "{{provider}}"),),
            "s",
        ),
        Panel(
            "Answered 429 / 503 per second (limits, full queues)",
            (
                (
                    f'sum by (model, status) (rate({REQ}{{model=~"$model",status=~"429|503"}}[{RATE}])) or vector(0)',
                    "{{model}} {{status}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "Batch lines preempted for interactive requests /s",
            (
                (
                    f"sum by (model) (rate(iop_edge_batch_preemptions_total{MODEL}[{RATE}])) or vector(0)",
                    "{{model}}",
                ),
            ),
        ),
    ),
    (MODEL_VAR,),
)

KEY = '{key=~"$key"}'
KEYS = Dashboard(
    "iop-keys",
    "IOP / Keys",
    'Usage per API key: requests and tokens by key and API (key "" is the open API)',
    (
        Panel(
            "Requests/s by key",
            ((f"sum by (key) (rate({REQ}{KEY}[{RATE}]))", "{{key}}"),),
            "reqps",
        ),
        Panel(
            "Tokens/s by key and kind",
            (
                (
                    f"sum by (key, kind) (rate(iop_edge_tokens_total{KEY}[{RATE}]))",
                    "{{key}} {{kind}}",
                ),
            ),
        ),
        Panel(
            "Requests/s by key and API",
            ((f"sum by (key, api) (rate({REQ}{KEY}[{RATE}]))", "{{key}} {{api}}"),),
            "reqps",
        ),
        Panel(
            "Non-2xx answers/s by key and status",
            (
                (
                    f'sum by (key, status) (rate({REQ}{{key=~"$key",status!~"2.."}}[{RATE}])) or vector(0)',
                    "{{key}} {{status}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "Tokens in the last 24 hours, by key and model",
            (
                (
                    f"sum by (key, model) (increase(iop_edge_tokens_total{KEY}[24h]))",
                    "{{key}} {{model}}",
                ),
            ),
            kind="table",
            width=24,
        ),
    ),
    (("key", "label_values(iop_edge_requests_total, key)"),),
)

BATCHES = Dashboard(
    "iop-batches",
    "IOP / Batches",
    "Batch jobs (OpenAI Batch API): statuses, lines, the workers' leases",
    (
        Panel("Batches by status", (("sum by (status) (iop_edge_batches)", "{{status}}"),)),
        Panel(
            "Lines finished/s by outcome (edge)",
            ((f"sum by (outcome) (rate(iop_edge_batch_lines_total[{RATE}]))", "{{outcome}}"),),
            "ops",
        ),
        Panel(
            "Worker lines/s by outcome",
            ((f"sum by (outcome) (rate(iop_worker_lines_total[{RATE}]))", "{{outcome}}"),),
            "ops",
        ),
        Panel(
            "Lines in flight (workers)",
            (("sum by (instance) (iop_worker_lines_in_flight)", "{{instance}}"),),
        ),
        Panel(
            "Lease renewals and expiries (last hour)",
            (
                ("sum(increase(iop_edge_batch_lease_renewals_total[1h]))", "renewed"),
                ("sum(increase(iop_edge_batch_lease_expiries_total[1h]))", "expired"),
                ("sum(increase(iop_worker_leases_lost_total[1h]))", "lost by a worker"),
            ),
            kind="stat",
        ),
        Panel(
            "Workers registered with an edge",
            (("sum by (instance) (iop_worker_edge_connected)", "{{instance}}"),),
            kind="stat",
        ),
    ),
)

EXPIRY = Dashboard(
    "iop-expiry",
    "IOP / Certificates and credentials",
    "What expires: every service's certificate and CAs; keys and node tokens with an expiry",
    (
        Panel(
            "Days left per certificate",
            (
                (
                    "min by (service, instance, cert, subject) (iop_certificate_expiry_timestamp_seconds - time()) / 86400",
                    "{{service}} {{instance}} {{cert}} {{subject}}",
                ),
            ),
            kind="table",
            width=24,
        ),
        Panel(
            "Soonest certificate expiry",
            (("min(iop_certificate_expiry_timestamp_seconds) - time()", "soonest"),),
            "s",
            kind="stat",
        ),
        Panel(
            "API keys: days left",
            (
                (
                    '(iop_credential_expiry_timestamp_seconds{kind="api_key"} - time()) / 86400',
                    "{{id}}",
                ),
            ),
            kind="table",
        ),
        Panel(
            "Node tokens: days left",
            (
                (
                    '(iop_credential_expiry_timestamp_seconds{kind="node_token"} - time()) / 86400',
                    "{{id}}",
                ),
            ),
            kind="table",
        ),
    ),
)

DASHBOARDS = (EDGE, NODES, QUEUES, KEYS, BATCHES, EXPIRY)


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "transparent": False,
        "transformations": [],
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        if panel.kind == "timeseries"
        else {},
        "targets": [
            {
                "refId": chr(ord("A") + n),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
                "instant": panel.kind != "timeseries",
                "range": panel.kind == "timeseries",
                **({"format": "table"} if panel.kind == "table" else {}),
            }
            for n, (expr, legend) in enumerate(panel.targets)
        ],
    }


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "hide": 0,
        "skipUrlSync": False,
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time range change
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    panels, x, y = [], 0, 0
    for panel_id, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        panels.append(_panel(panel, panel_id, x, y))
        x += panel.width
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["iop"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {
                "title": "IOP",
                "type": "dashboards",
                "tags": ["iop"],
                "asDropdown": True,
                "icon": "external link",
                "tooltip": "",
                "url": "",
                "targetBlank": False,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": [_variable(name, q) for name, q in dashboard.variables]},
        "panels": panels,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    stale = []
    for dashboard in DASHBOARDS:
        path = OUT / f"{dashboard.uid.removeprefix('iop-')}.json"
        text = json.dumps(render(dashboard), indent=2) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale (run tools/grafana_dashboards.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
