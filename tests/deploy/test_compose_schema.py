"""Both compose files validate against the Compose specification's JSON schema.

The schema is the one the `check-jsonschema` package ships (`vendor.compose-spec`, from
github.com/compose-spec/compose-spec, Apache-2.0; its licence file is in the package beside the
schema), so no copy lives in this repository and `pip install -U check-jsonschema` refreshes it.
The same check by hand: `check-jsonschema --builtin-schema vendor.compose-spec FILE`.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator, Draft202012Validator
from jsonschema.protocols import Validator

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [
    ROOT / "docker-compose.yml",
    ROOT / "deploy" / "node-host" / "docker-compose.node.yml",
]
SCHEMA_PACKAGE = "check_jsonschema.builtin_schemas.vendor"


@functools.cache
def schema() -> dict[str, Any]:
    text = (resources.files(SCHEMA_PACKAGE) / "compose-spec.json").read_text()
    document = json.loads(text)
    assert isinstance(document, dict)
    return document


@functools.cache
def validator() -> Validator:
    # Older releases of the schema declare draft-07 (as "https://...draft-07/schema", which
    # jsonschema does not recognise by that spelling), newer ones 2020-12.
    declared = schema().get("$schema", "")
    cls: type[Validator] = Draft7Validator if "draft-07" in declared else Draft202012Validator
    cls.check_schema(schema())
    return cls(schema())


def load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())  # also resolves the `<<: *anchor` merges
    assert isinstance(document, dict)
    return document


def test_the_schema_is_the_compose_specification() -> None:
    assert schema()["title"] == "Compose Specification"
    licence = resources.files(SCHEMA_PACKAGE) / "licenses" / "LICENSE.compose-spec"
    assert "Apache License" in licence.read_text()


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_compose_file_validates_against_the_compose_schema(path: Path) -> None:
    errors = [
        f"{error.json_path}: {error.message}" for error in validator().iter_errors(load(path))
    ]
    assert errors == []


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_the_schema_refuses_a_broken_copy(path: Path) -> None:
    """The validation above is not vacuous: the same schema rejects a typo'd key."""
    document = copy.deepcopy(load(path))
    service = next(iter(document["services"].values()))
    service["healthchek"] = service.pop("healthcheck", {})
    service["depends_on"] = {"nowhere": {"condition": "sometime"}}
    messages = " ".join(error.message for error in validator().iter_errors(document))
    assert "healthchek" in messages
    assert "sometime" in messages
