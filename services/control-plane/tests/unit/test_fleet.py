"""The fleet file: its shape, every validation rule (by the entry it names), and its wire form."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from iop_control_plane.adapters.fleet_file import load_fleet_file
from iop_control_plane.adapters.fleet_proto import (
    fleet_view,
    models_to_proto,
    node_config_to_proto,
)
from iop_control_plane.domain.fleet import FleetSpec, ProviderSpec, parse_fleet
from iop_control_plane.errors import ControlPlaneError, FleetConfigError
from iop_proto.v1 import runtime_pb2 as pb

ROOT = Path(__file__).resolve().parents[4]


def fleet() -> dict[str, Any]:
    """A valid fleet in the shape of ARCHITECTURE.md; each test breaks one thing."""
    return {
        "models": [
            {
                "id": "qwen3.6:35b",
                "display_name": "Qwen 3.6 35B",
                "providers": {"gpu-a-vllm": "Qwen/Qwen3.6-35B", "mac-ollama": "qwen3.6:35b"},
            },
            {"id": "small", "providers": {"gpu-a-vllm": "B"}},
        ],
        "nodes": [
            {
                "id": "gpu-a",
                "providers": [
                    {
                        "id": "gpu-a-vllm",
                        "type": "vllm",
                        "category": "local_inference",
                        "endpoint": "http://127.0.0.1:8000",
                        "models": ["Qwen/Qwen3.6-35B", "B"],
                        "capacity": 8,
                        "max_queue": 64,
                        "queue_timeout_ms": 30000,
                        "request_timeout_ms": 600000,
                    }
                ],
            },
            {
                "id": "mac",
                "providers": [
                    {
                        "id": "mac-ollama",
                        "type": "ollama",
                        "category": "local_inference",
                        "endpoint": "http://mac.lan:11434",
                        "models": ["qwen3.6:35b"],
                    }
                ],
            },
        ],
    }


def vllm(data: dict[str, Any]) -> dict[str, Any]:
    provider: dict[str, Any] = data["nodes"][0]["providers"][0]
    return provider


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(FleetConfigError) as caught:
        parse_fleet(data, "fleet.yaml")
    assert caught.value.source == "fleet.yaml"
    return caught.value.problems


def test_a_valid_fleet_parses_with_defaults_and_lookups() -> None:
    data = fleet()
    parsed = parse_fleet(data, "fleet.yaml")
    spec = parsed.spec
    assert parsed.warnings == []
    assert [m.id for m in spec.models] == ["qwen3.6:35b", "small"]
    assert spec.models[1].display_name == "small"  # defaults to the id
    mac = spec.nodes[1].providers[0]
    assert (mac.capacity, mac.max_queue, mac.queue_timeout_ms, mac.request_timeout_ms) == (
        1,
        16,
        30_000,
        600_000,
    )
    assert spec.node("mac") is spec.nodes[1]
    assert spec.node("nope") is None
    found = spec.provider("gpu-a-vllm")
    assert found is not None
    assert (found[0].id, found[1].capacity) == ("gpu-a", 8)
    assert spec.provider("nope") is None
    assert [m.id for m in spec.models_of_provider("gpu-a-vllm")] == ["qwen3.6:35b", "small"]
    assert [m.id for m in spec.models_of_provider("mac-ollama")] == ["qwen3.6:35b"]
    assert FleetSpec.model_validate(data) == spec  # the model alone validates the same


def test_an_empty_fleet_and_a_node_without_providers_are_allowed() -> None:
    spec = parse_fleet({"nodes": [{"id": "spare"}]}, "fleet.yaml").spec
    assert spec.models == []
    assert spec.nodes[0].providers == []


def set_path(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return apply


def drop(*path: str | int) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return apply


VLLM = ("nodes", 0, "providers", 0)
RULES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "unknown provider id in models[].providers",
        set_path("models", 0, "providers", "ghost", value="x"),
        "models[qwen3.6:35b].providers[ghost]: no provider has id 'ghost' "
        "(known: gpu-a-vllm, mac-ollama)",
    ),
    (
        "served name missing from the provider's models",
        set_path("models", 0, "providers", "gpu-a-vllm", value="X"),
        "models[qwen3.6:35b].providers[gpu-a-vllm]: served name 'X' is not in that "
        "provider's models ['Qwen/Qwen3.6-35B', 'B']",
    ),
    (
        "duplicate model id",
        set_path("models", 1, "id", value="qwen3.6:35b"),
        "models: duplicate model id 'qwen3.6:35b'",
    ),
    (
        "duplicate node id",
        set_path("nodes", 1, "id", value="gpu-a"),
        "nodes: duplicate node id 'gpu-a'",
    ),
    (
        "duplicate provider id across nodes",
        lambda data: data["nodes"][1]["providers"].append({**vllm(data)}),
        "nodes[mac].providers[gpu-a-vllm]: duplicate provider id (first defined on node 'gpu-a')",
    ),
    (
        "category does not fit the type",
        set_path(*VLLM, "category", value="api"),
        "nodes[gpu-a].providers[gpu-a-vllm].category: 'api' does not fit type 'vllm' "
        "(allowed: local_inference)",
    ),
    (
        "capacity below 1",
        set_path(*VLLM, "capacity", value=0),
        "nodes[gpu-a].providers[gpu-a-vllm].capacity: "
        "Input should be greater than or equal to 1 (got 0)",
    ),
    (
        "negative queue timeout",
        set_path(*VLLM, "queue_timeout_ms", value=-1),
        "nodes[gpu-a].providers[gpu-a-vllm].queue_timeout_ms: "
        "Input should be greater than or equal to 0 (got -1)",
    ),
    (
        "negative request timeout",
        set_path(*VLLM, "request_timeout_ms", value=-5),
        "nodes[gpu-a].providers[gpu-a-vllm].request_timeout_ms: "
        "Input should be greater than or equal to 0 (got -5)",
    ),
    (
        "negative max_queue",
        set_path(*VLLM, "max_queue", value=-1),
        "nodes[gpu-a].providers[gpu-a-vllm].max_queue: "
        "Input should be greater than or equal to 0 (got -1)",
    ),
    (
        "capacity beyond the wire's uint32",
        set_path(*VLLM, "capacity", value=2**32),
        "nodes[gpu-a].providers[gpu-a-vllm].capacity: "
        "Input should be less than or equal to 4294967295 (got 4294967296)",
    ),
    (
        "a number given as a string",
        set_path(*VLLM, "capacity", value="8"),
        "nodes[gpu-a].providers[gpu-a-vllm].capacity: Input should be a valid integer (got '8')",
    ),
    (
        "endpoint missing for an HTTP engine",
        drop(*VLLM, "endpoint"),
        "nodes[gpu-a].providers[gpu-a-vllm].endpoint: required for type 'vllm'",
    ),
    (
        "endpoint not http(s)",
        set_path(*VLLM, "endpoint", value="ftp://gpu-a:8000"),
        "nodes[gpu-a].providers[gpu-a-vllm].endpoint: must be an http:// or https:// URL "
        "with a host (got 'ftp://gpu-a:8000')",
    ),
    (
        "endpoint with a bad port",
        set_path(*VLLM, "endpoint", value="http://gpu-a:99999"),
        "nodes[gpu-a].providers[gpu-a-vllm].endpoint: the URL's port is not a number "
        "in 0-65535 (got 'http://gpu-a:99999')",
    ),
    (
        "another type's setting",
        set_path(*VLLM, "command", value=["vllm", "serve"]),
        "nodes[gpu-a].providers[gpu-a-vllm].command: not a setting of type 'vllm' "
        "(it takes: endpoint, api_key_env)",
    ),
    (
        "api_key_env on ollama",
        set_path("nodes", 1, "providers", 0, "api_key_env", value="OLLAMA_KEY"),
        "nodes[mac].providers[mac-ollama].api_key_env: not a setting of type 'ollama' "
        "(it takes: endpoint, max_loaded_models)",
    ),
    (
        "api_key_env that is not a variable name",
        set_path(*VLLM, "api_key_env", value="sk-123 secret"),
        "nodes[gpu-a].providers[gpu-a-vllm].api_key_env: must be an environment variable "
        "name (letters, digits, '_') (got 'sk-123 secret')",
    ),
    (
        "a typo in a setting name",
        set_path(*VLLM, "endpont", value="http://x"),
        "nodes[gpu-a].providers[gpu-a-vllm].endpont: unknown key (got 'http://x')",
    ),
    (
        "unknown provider type",
        set_path(*VLLM, "type", value="tgi"),
        "nodes[gpu-a].providers[gpu-a-vllm].type: Input should be 'mock', 'cli', 'ollama', "
        "'vllm', 'sglang', 'lemonade', 'llamacpp', 'llamaswap' or 'openai_api' (got 'tgi')",
    ),
    (
        "no served models",
        set_path(*VLLM, "models", value=[]),
        "nodes[gpu-a].providers[gpu-a-vllm].models: "
        "List should have at least 1 item after validation, not 0 (got [])",
    ),
    (
        "a served name twice",
        set_path(*VLLM, "models", value=["B", "B", "Qwen/Qwen3.6-35B"]),
        "nodes[gpu-a].providers[gpu-a-vllm].models: duplicate served name(s) ['B'] "
        "(got ['B', 'B', 'Qwen/Qwen3.6-35B'])",
    ),
    (
        "a node id that is not DNS-label-like",
        set_path("nodes", 1, "id", value="Mac Studio"),
        "nodes[Mac Studio].id: must be 1-63 lowercase letters, digits, '-' or '_', "
        "starting and ending with a letter or digit (got 'Mac Studio')",
    ),
    (
        "a model id with a space",
        set_path("models", 1, "id", value="small model"),
        "models[small model].id: must be 1-256 letters, digits, '.', '_', ':', '/' or '-', "
        "starting with a letter or digit (got 'small model')",
    ),
    (
        "a model without providers",
        set_path("models", 1, "providers", value={}),
        "models[small].providers: Dictionary should have at least 1 item after validation, not 0",
    ),
    (
        "an unknown top-level key",
        set_path("version", value=3),
        "version: unknown top-level key (allowed: models, nodes, openai)",
    ),
]


@pytest.mark.parametrize(("change", "expected"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_rule_refuses_the_file_naming_the_entry(
    change: Callable[[dict[str, Any]], None], expected: str
) -> None:
    data = fleet()
    change(data)
    assert problems_of(data) == [expected]


def test_an_entry_without_id_is_named_by_its_index() -> None:
    data = fleet()
    del vllm(data)["id"]
    problems = problems_of(data)
    assert problems[0] == "nodes[gpu-a].providers[0].id: Field required"


def test_every_problem_is_reported_not_only_the_first() -> None:
    data = fleet()
    vllm(data)["capacity"] = 0  # a field error: pydantic skips the fleet's own validator ...
    data["nodes"][1]["providers"][0]["category"] = "cli"
    data["models"][0]["providers"]["ghost"] = "x"  # ... yet the references are still checked
    data["models"][1]["id"] = "qwen3.6:35b"
    data["nodes"][1]["id"] = "gpu-a"
    assert problems_of(data) == [
        "nodes[gpu-a].providers[gpu-a-vllm].capacity: "
        "Input should be greater than or equal to 1 (got 0)",
        "nodes[gpu-a].providers[mac-ollama].category: 'cli' does not fit type 'ollama' "
        "(allowed: local_inference)",
        "models: duplicate model id 'qwen3.6:35b'",
        "nodes: duplicate node id 'gpu-a'",
        "models[qwen3.6:35b].providers[ghost]: no provider has id 'ghost' "
        "(known: gpu-a-vllm, mac-ollama)",
    ]


def test_one_provider_reports_all_its_own_problems() -> None:
    data = fleet()
    vllm(data).update(category="cli", tokens_per_second=3, prompt_via="argument")
    del vllm(data)["endpoint"]
    where = "nodes[gpu-a].providers[gpu-a-vllm]"
    assert problems_of(data) == [
        f"{where}.category: 'cli' does not fit type 'vllm' (allowed: local_inference)",
        f"{where}.endpoint: required for type 'vllm'",
        f"{where}.prompt_via: not a setting of type 'vllm' (it takes: endpoint, api_key_env)",
        f"{where}.tokens_per_second: not a setting of type 'vllm' "
        "(it takes: endpoint, api_key_env)",
    ]


def provider(**fields: Any) -> ProviderSpec:
    return ProviderSpec.model_validate({"id": "p", "models": ["m"], **fields})


@pytest.mark.parametrize("category", ["api", "cli", "local_inference"])
def test_a_mock_fits_every_category(category: str) -> None:
    assert provider(type="mock", category=category).category == category


@pytest.mark.parametrize(
    ("type_", "category", "settings", "allowed"),
    [
        ("cli", "local_inference", {"command": ["llm"]}, "cli"),
        ("openai_api", "local_inference", {"endpoint": "https://api.example.com"}, "api"),
        ("llamacpp", "api", {"endpoint": "http://h:8091"}, "local_inference"),
    ],
)
def test_other_types_fit_only_their_category(
    type_: str, category: str, settings: dict[str, Any], allowed: str
) -> None:
    expected = f"category: {category!r} does not fit type {type_!r} (allowed: {allowed})"
    with pytest.raises(ValidationError, match=re.escape(expected)):
        provider(type=type_, category=category, **settings)


def test_cli_needs_a_command_with_a_program() -> None:
    data = fleet()
    vllm(data).update(type="cli", category="cli", endpoint=None)
    assert problems_of(data) == [
        "nodes[gpu-a].providers[gpu-a-vllm].command: required for type 'cli'"
    ]
    vllm(data)["command"] = ["", "-m"]
    assert problems_of(data) == [
        "nodes[gpu-a].providers[gpu-a-vllm].command: the program (first element) must not "
        "be empty (got ['', '-m'])"
    ]


def test_type_settings_holds_only_the_types_own_settings_with_defaults() -> None:
    assert provider(type="mock", category="api").type_settings() == {
        "tokens_per_second": 50.0,
        "default_tokens": 32,
    }
    assert provider(
        type="mock", category="cli", tokens_per_second=7.5, default_tokens=4
    ).type_settings() == {"tokens_per_second": 7.5, "default_tokens": 4}
    cli = provider(type="cli", category="cli", command=["llm", "-m", "{model}"])
    assert cli.type_settings() == {"command": ["llm", "-m", "{model}"], "prompt_via": "stdin"}
    cli.type_settings()["command"].append("changed")  # a copy: the frozen spec is untouched
    assert cli.command == ["llm", "-m", "{model}"]
    ollama = provider(type="ollama", category="local_inference", endpoint="http://h:11434")
    assert ollama.type_settings() == {"endpoint": "http://h:11434", "max_loaded_models": None}
    swap = provider(
        type="llamaswap", category="local_inference", endpoint="http://h:8080", max_loaded_models=1
    )  # llama-swap's groups are in its own config: the fleet says how many it runs
    assert swap.type_settings() == {
        "endpoint": "http://h:8080",
        "api_key_env": None,
        "max_loaded_models": 1,
    }
    api = provider(
        type="openai_api",
        category="api",
        endpoint="https://api.example.com/v1",
        api_key_env="UPSTREAM_KEY",
    )
    assert api.type_settings() == {
        "endpoint": "https://api.example.com/v1",
        "api_key_env": "UPSTREAM_KEY",
    }
    assert provider(
        type="vllm", category="local_inference", endpoint="http://h:8000"
    ).type_settings() == {"endpoint": "http://h:8000", "api_key_env": None}
    for spec in (cli, ollama, api):
        assert json.loads(json.dumps(spec.type_settings())) == spec.type_settings()


def test_the_spec_is_frozen() -> None:
    spec = parse_fleet(fleet(), "fleet.yaml").spec
    with pytest.raises(ValueError, match="frozen"):
        spec.nodes[0].providers[0].capacity = 3


# ---------------------------------------------------------------- the file


def test_the_example_fleet_file_parses() -> None:
    parsed = load_fleet_file(ROOT / "configs" / "fleet.yaml")
    spec = parsed.spec
    assert parsed.warnings == []
    assert [m.id for m in spec.models] == ["smollm2:135m", "mock-small"]
    assert spec.models[0].providers == {"node-a-llamacpp": "smollm2:135m"}
    assert spec.models[1].providers == {"node-a-mock": "mock-small", "node-b-mock": "mock-small-b"}
    assert [(n.id, [p.id for p in n.providers]) for n in spec.nodes] == [
        ("node-a", ["node-a-llamacpp", "node-a-mock"]),
        ("node-b", ["node-b-mock"]),
    ]
    found = spec.provider("node-a-llamacpp")
    assert found is not None
    llamacpp = found[1]
    assert (llamacpp.type, llamacpp.category, llamacpp.capacity) == (
        "llamacpp",
        "local_inference",
        1,
    )
    assert llamacpp.endpoint == "http://127.0.0.1:8091"
    for mock_id in ("node-a-mock", "node-b-mock"):
        found = spec.provider(mock_id)
        assert found is not None
        mock = found[1]
        assert (mock.type, mock.category, mock.capacity, mock.max_queue) == (
            "mock",
            "local_inference",
            2,
            16,
        )
        assert mock.tokens_per_second == 50


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("models: [\n", "YAML syntax error at line 2, column 1: "),
        ("- id: a\n", "the top level must be a mapping with models and nodes (got a list)"),
        ("", "the file is empty; expected a mapping with models and nodes"),
        ("models: []\nmodels: []\n", "YAML syntax error at line 2, column 1: found duplicate key"),
        ("nodes: [{id: Bad}]\n", "nodes[Bad].id: must be 1-63 lowercase letters"),
    ],
    ids=["syntax", "not-a-mapping", "empty", "duplicate-key", "invalid-content"],
)
def test_a_bad_file_is_refused_naming_the_path(tmp_path: Path, text: str, problem: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(FleetConfigError) as caught:
        load_fleet_file(path)
    assert caught.value.source == str(path)
    assert caught.value.problems[0].startswith(problem)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, ControlPlaneError)


def test_a_duplicate_provider_key_in_a_model_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  - id: m\n    providers:\n      p: a\n      p: b\n")
    with pytest.raises(FleetConfigError, match="found duplicate key 'p'"):
        load_fleet_file(path)


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    text = (
        "nodes:\n  - id: n\n    providers:\n"
        "      - &base {id: a, type: mock, category: api, models: [m], capacity: 2}\n"
        "      - {<<: *base, id: b}\n"
    )
    spec = load_fleet_file(write(tmp_path, text)).spec
    assert [(p.id, p.capacity) for p in spec.nodes[0].providers] == [("a", 2), ("b", 2)]


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FleetConfigError) as caught:
        load_fleet_file(tmp_path / "absent.yaml")
    assert caught.value.problems == ["file not found"]


# ---------------------------------------------------------------- wire and view


def test_node_config_carries_the_providers_and_their_type_settings() -> None:
    spec = parse_fleet(fleet(), "fleet.yaml").spec
    message = node_config_to_proto(spec.nodes[0])
    assert message.node_id == "gpu-a"
    (config,) = message.providers
    assert (config.id, config.type, config.category) == (
        "gpu-a-vllm",
        "vllm",
        pb.PROVIDER_CATEGORY_LOCAL_INFERENCE,
    )
    assert list(config.models) == ["Qwen/Qwen3.6-35B", "B"]
    assert (config.capacity, config.max_queue) == (8, 64)
    assert (config.queue_timeout_ms, config.request_timeout_ms) == (30000, 600000)
    assert json.loads(config.settings_json) == spec.nodes[0].providers[0].type_settings()
    assert config.settings_json == b'{"api_key_env":null,"endpoint":"http://127.0.0.1:8000"}'
    assert pb.NodeConfig.FromString(message.SerializeToString()) == message


@pytest.mark.parametrize(
    ("category", "expected"),
    [
        ("api", pb.PROVIDER_CATEGORY_API),
        ("cli", pb.PROVIDER_CATEGORY_CLI),
        ("local_inference", pb.PROVIDER_CATEGORY_LOCAL_INFERENCE),
    ],
)
def test_categories_map_to_the_proto_enum(category: str, expected: int) -> None:
    node = {
        "id": "n",
        "providers": [{"id": "p", "type": "mock", "category": category, "models": ["m"]}],
    }
    spec = parse_fleet({"nodes": [node]}, "fleet.yaml").spec
    config = node_config_to_proto(spec.nodes[0]).providers[0]
    assert config.category == expected
    assert json.loads(config.settings_json) == {"tokens_per_second": 50.0, "default_tokens": 32}


def test_models_to_proto_is_the_catalog() -> None:
    spec = parse_fleet(fleet(), "fleet.yaml").spec
    models = models_to_proto(spec)
    assert [(m.id, m.display_name, dict(m.providers)) for m in models] == [
        (
            "qwen3.6:35b",
            "Qwen 3.6 35B",
            {"gpu-a-vllm": "Qwen/Qwen3.6-35B", "mac-ollama": "qwen3.6:35b"},
        ),
        ("small", "small", {"gpu-a-vllm": "B"}),
    ]


def test_a_models_output_cap_defaults_and_reaches_the_edge() -> None:
    data = fleet()
    data["models"][1]["max_output_tokens"] = 4096
    models = models_to_proto(parse_fleet(data, "fleet.yaml").spec)
    assert [m.max_output_tokens for m in models] == [32768, 4096]


@pytest.mark.parametrize("cap", [0, -1, 2**32, "4096", 1.5])
def test_a_bad_output_cap_is_refused_naming_the_model(cap: object) -> None:
    data = fleet()
    data["models"][1]["max_output_tokens"] = cap
    with pytest.raises(FleetConfigError, match=r"models\[small\]\.max_output_tokens"):
        parse_fleet(data, "fleet.yaml")


def test_a_models_context_window_is_optional_and_reaches_the_edge() -> None:
    data = fleet()
    data["models"][1]["context_window"] = 8192
    data["models"][1]["max_output_tokens"] = 2048
    models = models_to_proto(parse_fleet(data, "fleet.yaml").spec)
    assert [(m.context_window, m.max_output_tokens) for m in models] == [(0, 32768), (8192, 2048)]


@pytest.mark.parametrize(
    ("window", "cap", "message"),
    [
        (0, 1024, r"models\[small\]\.context_window"),
        (2**32, 1024, r"models\[small\]\.context_window"),
        ("8192", 1024, r"models\[small\]\.context_window"),
        (2048, 2048, r"models\[small\]\.max_output_tokens: must be below context_window \(2048\)"),
        (2048, None, r"it is 32768 by default"),  # the default cap does not fit either
    ],
)
def test_a_bad_context_window_or_a_cap_that_leaves_no_room_is_refused(
    window: object, cap: int | None, message: str
) -> None:
    data = fleet()
    data["models"][1]["context_window"] = window
    if cap is not None:
        data["models"][1]["max_output_tokens"] = cap
    with pytest.raises(FleetConfigError, match=message):
        parse_fleet(data, "fleet.yaml")


def test_a_models_retries_default_to_two_and_zero_reaches_the_edge_as_a_value() -> None:
    data = fleet()
    data["models"][1]["retries"] = 0  # failover off for this model
    models = models_to_proto(parse_fleet(data, "fleet.yaml").spec)
    assert [(m.HasField("retries"), m.retries) for m in models] == [(True, 2), (True, 0)]


@pytest.mark.parametrize("retries", [-1, 11, "2", 1.5])
def test_bad_retries_are_refused_naming_the_model(retries: object) -> None:
    data = fleet()
    data["models"][1]["retries"] = retries
    with pytest.raises(FleetConfigError, match=r"models\[small\]\.retries"):
        parse_fleet(data, "fleet.yaml")


def test_fleet_view_is_json_ready_and_names_only_the_key_variable() -> None:
    data = fleet()
    vllm(data)["api_key_env"] = "VLLM_API_KEY"
    view = fleet_view(parse_fleet(data, "fleet.yaml").spec)
    assert json.loads(json.dumps(view)) == view
    assert view["models"][0]["providers"][0] == {
        "provider_id": "gpu-a-vllm",
        "node_id": "gpu-a",
        "served_name": "Qwen/Qwen3.6-35B",
        "type": "vllm",
        "category": "local_inference",
    }
    assert view["nodes"][0]["providers"][0] == {
        "id": "gpu-a-vllm",
        "type": "vllm",
        "category": "local_inference",
        "models": ["Qwen/Qwen3.6-35B", "B"],
        "capacity": 8,
        "max_queue": 64,
        "queue_timeout_ms": 30000,
        "request_timeout_ms": 600000,
        "operations": ["chat_completions", "completions", "embeddings"],
        "settings": {"endpoint": "http://127.0.0.1:8000", "api_key_env": "VLLM_API_KEY"},
    }


def test_operations_default_to_the_types_and_a_listed_subset_is_sent_to_the_edge() -> None:
    data = fleet()
    data["nodes"][1]["providers"][0]["operations"] = ["embeddings", "chat_completions"]
    data["nodes"].append(
        {
            "id": "box",
            "providers": [
                {"id": "box-cli", "type": "cli", "category": "cli", "command": ["echo"],
                 "models": ["echo"]},
            ],
        }
    )  # fmt: skip
    spec = parse_fleet(data, "fleet.yaml").spec
    offered = {
        p.id: list(p.operations)
        for node in spec.nodes
        for p in node_config_to_proto(node).providers
    }
    assert offered == {
        "gpu-a-vllm": ["chat_completions", "completions", "embeddings"],  # the type's: all
        "mac-ollama": ["chat_completions", "embeddings"],  # as listed, in a fixed order
        "box-cli": ["chat_completions", "completions"],  # a program has no embeddings
    }
    assert fleet_view(spec)["nodes"][1]["providers"][0]["operations"] == [
        "chat_completions",
        "embeddings",
    ]


@pytest.mark.parametrize(
    ("provider", "operations", "expected"),
    [
        (0, ["embeddings", "images"], "nodes[gpu-a].providers[gpu-a-vllm].operations[1]: Input "
         "should be 'chat_completions', 'completions' or 'embeddings' (got 'images')"),
        (1, [], "nodes[mac].providers[mac-ollama].operations: List should have at least 1 "
         "item after validation, not 0 (got [])"),
    ],
)  # fmt: skip
def test_unknown_or_no_operations_are_refused_naming_the_provider(
    provider: int, operations: list[str], expected: str
) -> None:
    data = fleet()
    data["nodes"][provider]["providers"][0]["operations"] = operations
    assert problems_of(data) == [expected]


def test_a_cli_provider_cannot_claim_embeddings() -> None:
    data = fleet()
    data["nodes"][1]["providers"][0] = {
        "id": "box-cli",
        "type": "cli",
        "category": "cli",
        "command": ["echo"],
        "models": ["qwen3.6:35b"],
        "operations": ["chat_completions", "embeddings"],
    }
    data["models"][0]["providers"] = {"gpu-a-vllm": "B", "box-cli": "qwen3.6:35b"}
    assert problems_of(data) == [
        "nodes[mac].providers[box-cli].operations: type 'cli' does not offer embeddings"
    ]
