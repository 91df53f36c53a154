"""The legacy ``openai.model_routes[]`` shape: conversion, warnings, problems, round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from iop_control_plane.adapters.fleet_file import load_fleet_file
from iop_control_plane.adapters.fleet_proto import models_to_proto, node_config_to_proto
from iop_control_plane.domain.fleet import ALLOWED_CATEGORIES, TYPE_SETTINGS, parse_fleet
from iop_control_plane.domain.legacy import NATURAL_CATEGORY, to_legacy_routes
from iop_control_plane.errors import FleetConfigError

ROOT = Path(__file__).resolve().parents[4]


def routes() -> list[dict[str, Any]]:
    """Legacy routes, each model's routes together (the order `to_legacy_routes` writes)."""
    return [
        {"model": "qwen3.6:35b", "adapter": "vllm", "target": "Qwen/Qwen3.6-35B", "node": "gpu-a",
         "endpoint": "http://127.0.0.1:8000", "capacity": 8},
        {"model": "qwen3.6:35b", "adapter": "ollama", "target": "qwen3.6:35b", "node": "mac",
         "endpoint": "http://mac.lan:11434"},
        {"model": "small", "adapter": "vllm", "target": "Qwen/Small", "node": "gpu-a",
         "endpoint": "http://127.0.0.1:8000", "capacity": 8},
        {"model": "echo", "adapter": "cli", "target": "echo", "node": "mac",
         "command": ["cat"], "prompt_via": "stdin"},
        {"model": "remote", "adapter": "openai_api", "target": "gpt-4o-mini", "node": "mac",
         "endpoint": "https://api.openai.com/v1", "api_key_env": "OPENAI_API_KEY",
         "request_timeout_ms": 60000},
        {"model": "fake", "adapter": "mock", "target": "fake", "node": "gpu-a",
         "category": "api", "tokens_per_second": 1000.0},
    ]  # fmt: skip


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(FleetConfigError) as caught:
        parse_fleet(data, "fleet.yaml")
    return caught.value.problems


def test_routes_become_providers_per_node_and_adapter_and_models_per_name() -> None:
    spec = parse_fleet({"openai": {"model_routes": routes()}}, "fleet.yaml").spec
    assert [(n.id, [p.id for p in n.providers]) for n in spec.nodes] == [
        ("gpu-a", ["gpu-a-vllm", "gpu-a-mock"]),
        ("mac", ["mac-ollama", "mac-cli", "mac-openai_api"]),
    ]
    found = spec.provider("gpu-a-vllm")
    assert found is not None
    gpu = found[1]
    assert (gpu.type, gpu.category, gpu.capacity) == ("vllm", "local_inference", 8)
    assert gpu.models == ["Qwen/Qwen3.6-35B", "Qwen/Small"]  # every target, in route order
    assert gpu.endpoint == "http://127.0.0.1:8000"
    categories = {p.id: p.category for n in spec.nodes for p in n.providers}
    assert categories == {
        "gpu-a-vllm": "local_inference",
        "gpu-a-mock": "api",  # the route's own category wins over the natural one
        "mac-ollama": "local_inference",
        "mac-cli": "cli",
        "mac-openai_api": "api",
    }
    assert [(m.id, m.display_name, m.providers) for m in spec.models] == [
        ("qwen3.6:35b", "qwen3.6:35b",
         {"gpu-a-vllm": "Qwen/Qwen3.6-35B", "mac-ollama": "qwen3.6:35b"}),
        ("small", "small", {"gpu-a-vllm": "Qwen/Small"}),
        ("echo", "echo", {"mac-cli": "echo"}),
        ("remote", "remote", {"mac-openai_api": "gpt-4o-mini"}),
        ("fake", "fake", {"gpu-a-mock": "fake"}),
    ]  # fmt: skip


def test_a_legacy_mock_defaults_to_local_inference() -> None:
    route = {"model": "m", "adapter": "mock", "target": "t", "node": "n"}
    spec = parse_fleet({"openai": {"model_routes": [route]}}, "fleet.yaml").spec
    assert spec.nodes[0].providers[0].category == "local_inference"


def test_the_natural_categories_fit_the_types() -> None:
    assert set(NATURAL_CATEGORY) == set(ALLOWED_CATEGORIES) == set(TYPE_SETTINGS)
    for type_, category in NATURAL_CATEGORY.items():
        assert category in ALLOWED_CATEGORIES[type_]


def test_each_converted_route_earns_a_deprecation_warning() -> None:
    parsed = parse_fleet({"openai": {"model_routes": routes()[:2]}}, "fleet.yaml")
    assert parsed.warnings == [
        "openai.model_routes[0] (model 'qwen3.6:35b', adapter 'vllm', node 'gpu-a') is "
        "deprecated: converted to models[qwen3.6:35b].providers[gpu-a-vllm] = "
        "'Qwen/Qwen3.6-35B'; move it to models[]/nodes[]",
        "openai.model_routes[1] (model 'qwen3.6:35b', adapter 'ollama', node 'mac') is "
        "deprecated: converted to models[qwen3.6:35b].providers[mac-ollama] = "
        "'qwen3.6:35b'; move it to models[]/nodes[]",
    ]


def test_legacy_routes_round_trip() -> None:
    original = routes()
    spec = parse_fleet({"openai": {"model_routes": original}}, "fleet.yaml").spec
    exported = to_legacy_routes(spec)
    assert exported == original
    again = parse_fleet({"openai": {"model_routes": exported}}, "fleet.yaml").spec
    assert again == spec


def test_the_legacy_example_round_trips_and_is_the_dev_fleet() -> None:
    path = ROOT / "configs" / "fleet-legacy.example.yaml"
    parsed = load_fleet_file(path)
    assert len(parsed.warnings) == 3
    assert all("is deprecated: converted to models[" in w for w in parsed.warnings)
    original = yaml.safe_load(path.read_text(encoding="utf-8"))["openai"]["model_routes"]
    assert to_legacy_routes(parsed.spec) == original
    # the same fleet as configs/fleet.yaml on the wire, except for the display names
    current = load_fleet_file(ROOT / "configs" / "fleet.yaml").spec
    assert [node_config_to_proto(n) for n in parsed.spec.nodes] == [
        node_config_to_proto(n) for n in current.nodes
    ]
    assert [(m.id, dict(m.providers)) for m in models_to_proto(parsed.spec)] == [
        (m.id, dict(m.providers)) for m in models_to_proto(current)
    ]


def test_both_shapes_merge_and_a_legacy_node_joins_its_namesake() -> None:
    data = {
        "models": [{"id": "new", "providers": {"gpu-a-sglang": "served"}}],
        "nodes": [
            {
                "id": "gpu-a",
                "providers": [
                    {"id": "gpu-a-sglang", "type": "sglang", "category": "local_inference",
                     "endpoint": "http://127.0.0.1:30000", "models": ["served"]},
                ],
            }
        ],
        "openai": {"model_routes": routes()[:2]},
    }  # fmt: skip
    parsed = parse_fleet(data, "fleet.yaml")
    spec = parsed.spec
    assert [m.id for m in spec.models] == ["new", "qwen3.6:35b"]
    assert [(n.id, [p.id for p in n.providers]) for n in spec.nodes] == [
        ("gpu-a", ["gpu-a-sglang", "gpu-a-vllm"]),
        ("mac", ["mac-ollama"]),
    ]
    assert len(parsed.warnings) == 2


def test_a_model_in_both_shapes_is_refused() -> None:
    data = {
        "models": [{"id": "qwen3.6:35b", "providers": {"mac-ollama": "qwen3.6:35b"}}],
        "openai": {"model_routes": routes()[:2]},
    }
    assert problems_of(data)[:2] == [
        "openai.model_routes[0]: model 'qwen3.6:35b' is already defined in models[]; "
        "define it in one place",
        "openai.model_routes[1]: model 'qwen3.6:35b' is already defined in models[]; "
        "define it in one place",
    ]


@pytest.mark.parametrize(
    ("key", "second", "first"),
    [("endpoint", "'http://10.0.0.9:8000'", "'http://127.0.0.1:8000'"), ("capacity", "4", "8")],
)
def test_conflicting_settings_for_one_provider_name_both_routes(
    key: str, second: str, first: str
) -> None:
    changed = routes()
    changed[2][key] = {"endpoint": "http://10.0.0.9:8000", "capacity": 4}[key]
    assert problems_of({"openai": {"model_routes": changed}}) == [
        f"openai.model_routes[2].{key}: {second} conflicts with "
        f"openai.model_routes[0].{key} ({first}) for provider 'gpu-a-vllm'"
    ]


def test_a_setting_given_once_applies_to_every_route_of_the_provider() -> None:
    changed = routes()
    del changed[2]["endpoint"], changed[2]["capacity"]
    spec = parse_fleet({"openai": {"model_routes": changed}}, "fleet.yaml").spec
    found = spec.provider("gpu-a-vllm")
    assert found is not None
    assert (found[1].endpoint, found[1].capacity) == ("http://127.0.0.1:8000", 8)


def test_a_model_routed_twice_to_one_provider_is_refused() -> None:
    changed = [*routes()[:1], {**routes()[0], "target": "other"}]
    assert problems_of({"openai": {"model_routes": changed}}) == [
        "openai.model_routes[1]: model 'qwen3.6:35b' is already routed to provider "
        "'gpu-a-vllm' by openai.model_routes[0]; a model has one served name per provider"
    ]


@pytest.mark.parametrize(
    ("openai", "expected"),
    [
        (["x"], ["openai: must be a mapping with model_routes (got ['x'])"]),
        ({"model_routes": {"m": 1}},
         ["openai.model_routes: must be a list of routes (got {'m': 1})"]),
        ({"model_routes": [], "api_keys": []},
         ["openai.api_keys: unknown key (only model_routes is read)"]),
        ({"model_routes": ["m"]},
         ["openai.model_routes[0]: must be a mapping with model, adapter, target, node "
          "(got 'm')"]),
        ({"model_routes": [{"model": "m", "adapter": "mock", "target": ""}]},
         ["openai.model_routes[0].target: must be a non-empty string (got '')",
          "openai.model_routes[0].node: required"]),
        ({"model_routes": [{"model": "m", "adapter": "tgi", "target": "t", "node": "n"}]},
         ["openai.model_routes[0].adapter: unknown provider type 'tgi' (known: mock, cli, "
          "ollama, vllm, sglang, lemonade, llamacpp, llamaswap, openai_api)"]),
        ({"model_routes": [{"model": "m", "adapter": "mock", "target": "t", "node": "n",
                            "gpu": 1}]},
         ["openai.model_routes[0].gpu: unknown key"]),
    ],
    ids=["not-a-mapping", "not-a-list", "unknown-key", "route-not-a-mapping", "missing-keys",
         "unknown-adapter", "unknown-route-key"],
)  # fmt: skip
def test_malformed_legacy_sections_are_refused(openai: Any, expected: list[str]) -> None:
    assert problems_of({"openai": openai}) == expected


def test_an_invalid_converted_entry_points_back_to_its_routes() -> None:
    changed = routes()
    changed[0]["capacity"] = changed[2]["capacity"] = 0
    changed[1]["endpoint"] = "mac.lan:11434"
    assert problems_of({"openai": {"model_routes": changed}}) == [
        "nodes[gpu-a].providers[gpu-a-vllm].capacity: Input should be greater than or equal "
        "to 1 (got 0) (converted from openai.model_routes[0], openai.model_routes[2])",
        "nodes[mac].providers[mac-ollama].endpoint: must be an http:// or https:// URL with "
        "a host (got 'mac.lan:11434') (converted from openai.model_routes[1])",
    ]


def test_a_legacy_provider_id_clashing_with_a_new_one_is_refused() -> None:
    data = {
        "nodes": [
            {"id": "other", "providers": [
                {"id": "mac-ollama", "type": "ollama", "category": "local_inference",
                 "endpoint": "http://o:11434", "models": ["x"]}]}
        ],
        "openai": {"model_routes": routes()[1:2]},
    }  # fmt: skip
    assert problems_of(data) == [
        "nodes[mac].providers[mac-ollama]: duplicate provider id (first defined on node "
        "'other') (converted from openai.model_routes[0])"
    ]
