"""The observability profile's files: alert rules (``promtool``), Prometheus' settings, and the
Grafana dashboards against Grafana's dashboard schema.

DASHBOARD_SCHEMA is a JSON Schema written from Grafana's own definition of a dashboard
(kinds/dashboard/dashboard_kind.cue in github.com/grafana/grafana: its required fields and
ranges, for the parts these dashboards use), so no copy of it lives here; Grafana's loader
needs the same: panels with a type, a grid position inside 24 columns, targets with a refId,
field config and options, a schemaVersion. Beyond the schema: each panel's datasource is the
provisioned one, no two panels overlap, each ``$variable`` is defined, and the JSON is what
tools/grafana_dashboards.py writes. What the queries return: tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"

_REF = {"type": "object", "properties": {"type": {"type": "string"}, "uid": {"type": "string"}}}
_UINT = {"type": "integer", "minimum": 0}
_PANEL = {
    "type": "object",
    "required": ["type", "options", "fieldConfig", "transformations"],
    "properties": {
        "type": {"type": "string", "minLength": 1},
        "id": _UINT,
        "title": {"type": "string"},
        "transparent": {"type": "boolean"},
        "datasource": _REF,
        "gridPos": {
            "type": "object",
            "required": ["h", "w", "x", "y"],
            "properties": {
                "h": {"type": "integer", "minimum": 1},
                "w": {"type": "integer", "minimum": 1, "maximum": 24},
                "x": {"type": "integer", "minimum": 0, "maximum": 23},
                "y": _UINT,
            },
        },
        "targets": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["refId", "expr", "datasource"],
                "properties": {
                    "refId": {"type": "string", "minLength": 1},
                    "expr": {"type": "string", "minLength": 1},
                    "datasource": _REF,
                },
            },
        },
        "options": {"type": "object"},
        "transformations": {"type": "array"},
        "fieldConfig": {
            "type": "object",
            "required": ["defaults", "overrides"],
            "properties": {"defaults": {"type": "object"}, "overrides": {"type": "array"}},
        },
    },
}
DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "editable", "graphTooltip"],
    "properties": {
        "uid": {"type": "string", "minLength": 1, "maxLength": 40, "pattern": "^[A-Za-z0-9_-]+$"},
        "title": {"type": "string", "minLength": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "timezone": {"type": "string"},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "refresh": {"type": "string"},
        "schemaVersion": {"type": "integer", "minimum": 36, "maximum": 65535},
        "version": _UINT,
        "panels": {"type": "array", "minItems": 1, "items": _PANEL},
        "templating": {
            "type": "object",
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "name", "hide"],
                        "properties": {
                            "type": {
                                "enum": [
                                    "query",
                                    "adhoc",
                                    "constant",
                                    "datasource",
                                    "interval",
                                    "textbox",
                                    "custom",
                                    "system",
                                ]
                            },
                            "name": {"type": "string", "minLength": 1},
                            "hide": {"enum": [0, 1, 2]},
                            "datasource": _REF,
                            "query": {"type": ["string", "object"]},
                        },
                    },
                }
            },
        },
        "annotations": {"type": "object", "properties": {"list": {"type": "array"}}},
        "links": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "title",
                    "type",
                    "icon",
                    "tooltip",
                    "url",
                    "tags",
                    "asDropdown",
                    "targetBlank",
                    "includeVars",
                    "keepTime",
                ],
                "properties": {"type": {"enum": ["link", "dashboards"]}},
            },
        },
    },
}


def load(path: Path) -> dict[str, Any]:
    document = json.loads(path.read_text())
    assert isinstance(document, dict)
    return document


def test_the_dashboards_are_there() -> None:
    names = {path.stem for path in DASHBOARDS}
    assert {"edge", "nodes", "queues", "keys", "batches", "expiry"} <= names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_dashboard_matches_grafanas_schema(path: Path) -> None:
    Draft202012Validator.check_schema(DASHBOARD_SCHEMA)
    errors = [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in Draft202012Validator(DASHBOARD_SCHEMA).iter_errors(load(path))
    ]
    assert not errors


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_dashboard_is_coherent(path: Path) -> None:
    dashboard = load(path)
    provisioned = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    ids: set[int] = set()
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids, panel["title"]
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        assert panel["datasource"]["uid"] == provisioned
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == provisioned
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used - variables)


def test_the_json_is_what_the_generator_writes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "grafana_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs Debian's prometheus package (promtool; .ci/run installs it)")
    return promtool


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    count = sum(len(group["rules"]) for group in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_promtool_accepts_the_compose_prometheus_settings(tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml with its rule file where the container has it."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [_promtool(), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_profile_mounts_these_files() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"]
    mounts = [volume.split(":")[0] for volume in services["grafana"]["volumes"]]
    assert "./deploy/grafana/dashboards" in mounts
    prometheus = [volume.split(":")[0] for volume in services["prometheus"]["volumes"]]
    assert {"./deploy/prometheus/prometheus.yml", "./deploy/prometheus/alerts.yml"} <= set(
        prometheus
    )
    assert services["prometheus"]["build"]["dockerfile"] == "deploy/prometheus/Dockerfile"
