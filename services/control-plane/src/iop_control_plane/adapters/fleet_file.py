"""Read the fleet file: YAML on disk -> a validated `ParsedFleet`, or `FleetConfigError`.

Every way a file can be refused (missing, unreadable, bad YAML, wrong top level, invalid
content) ends as `FleetConfigError` naming the path, so the caller has one error to catch
and keeps its running fleet when a reload is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from iop_control_plane.domain.fleet import ParsedFleet, parse_fleet
from iop_control_plane.errors import FleetConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping.

    Plain YAML keeps the last value silently; in a fleet file that would hide a duplicated
    provider id in ``models[].providers`` or a setting written twice.
    """


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # "<<" merges may be overridden locally; that is fine
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable key: construct_mapping below reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_fleet_file(path: Path) -> ParsedFleet:
    """Read and validate the fleet file at ``path``; raises `FleetConfigError` if refused."""
    source = str(path)
    try:
        text = path.read_bytes()  # bytes: PyYAML detects UTF-8/UTF-16 and reports bad input
    except FileNotFoundError:
        raise FleetConfigError(source, ["file not found"]) from None
    except OSError as exc:
        raise FleetConfigError(source, [f"cannot read the file: {exc.strerror or exc}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # SafeLoader: builds no objects
    except yaml.YAMLError as exc:
        raise FleetConfigError(source, [_describe_yaml_error(exc)]) from None
    expected = "a mapping with models and nodes"
    if data is None:
        raise FleetConfigError(source, [f"the file is empty; expected {expected}"])
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise FleetConfigError(source, [f"the top level must be {expected} (got a {kind})"])
    return parse_fleet(data, source)


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = f" ({exc.context})" if exc.context else ""
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        return f"YAML syntax error at {where}: {exc.problem}{context}"
    return f"YAML error: {exc}"
