"""Protobuf only at the rim: each service converts the wire's types in a few named modules.

Every module of each service is parsed with ``ast`` (nothing is imported, so a
module's import-time work cannot hide or fake an import) and any import of the
generated code (``iop_proto.v1``, a ``*_pb2`` module, ``google.protobuf``) outside
the service's rim fails the test, naming the module and the line. The rims are the
ones docs/ARCHITECTURE.md states ("Protobuf at the rim").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RIMS: dict[str, tuple[str, frozenset[str]]] = {
    "edge": ("iop_edge", frozenset({"adapters/", "bootstrap.py"})),
    "node": ("iop_node", frozenset({"entrypoints/", "bootstrap.py"})),
    "control-plane": (
        "iop_control_plane",
        frozenset({"adapters/", "entrypoints/", "authority.py", "bootstrap.py"}),
    ),
    "worker": ("iop_worker", frozenset({"entrypoints/", "bootstrap.py"})),
}
"""Per service: its package, and the modules (a name) or folders (ending in ``/``) that
may import the generated code."""


def is_protobuf(module: str) -> bool:
    """Whether an imported module is generated protobuf code or its runtime."""
    parts = module.split(".")
    return (
        module == "iop_proto.v1"
        or module.startswith("iop_proto.v1.")
        or module == "google.protobuf"
        or module.startswith("google.protobuf.")
        or any(part.endswith("_pb2") or part.endswith("_pb2_grpc") for part in parts)
    )


def protobuf_imports(source: str, filename: str) -> list[int]:
    """The lines of ``source`` that import protobuf code, anywhere in the module
    (inside functions and ``if TYPE_CHECKING:`` blocks too)."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            if any(is_protobuf(alias.name) for alias in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            if is_protobuf(node.module) or any(is_protobuf(name) for name in names):
                lines.append(node.lineno)
    return sorted(lines)


def in_rim(relative: str, rim: frozenset[str]) -> bool:
    return any(
        relative.startswith(entry) if entry.endswith("/") else relative == entry for entry in rim
    )


def violations(package: Path, rim: frozenset[str]) -> list[str]:
    """``module:line`` for each protobuf import outside ``rim``, in a package's tree."""
    found: list[str] = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if in_rim(relative, rim):
            continue
        for line in protobuf_imports(path.read_text(), str(path)):
            found.append(f"{package.name}/{relative}:{line}")
    return found


def service_package(service: str) -> Path:
    package, _ = RIMS[service]
    path = ROOT / "services" / service / "src" / package
    assert (path / "__init__.py").is_file(), f"no package at {path}"
    return path


@pytest.mark.parametrize(
    "service",
    [
        "edge",
        "control-plane",
        "worker",
        "node",
    ],
)
def test_only_the_rim_imports_protobuf(service: str) -> None:
    package = service_package(service)
    modules = list(package.rglob("*.py"))
    assert len(modules) > 5  # the tree was found and walked
    assert violations(package, RIMS[service][1]) == []


@pytest.mark.parametrize("service", sorted(RIMS))
def test_the_rim_named_exists(service: str) -> None:
    """A rim entry that names nothing would let a renamed module escape the check."""
    package = service_package(service)
    for entry in RIMS[service][1]:
        assert (package / entry.rstrip("/")).exists(), f"{service}: {entry} is gone"


def test_a_protobuf_import_outside_the_rim_is_caught(tmp_path: Path) -> None:
    package = tmp_path / "iop_fake"
    (package / "adapters").mkdir(parents=True)
    (package / "domain").mkdir()
    (package / "__init__.py").write_text("")
    (package / "adapters" / "wire.py").write_text("from iop_proto.v1 import runtime_pb2 as pb\n")
    (package / "bootstrap.py").write_text("import iop_proto.v1.runtime_pb2\n")
    (package / "domain" / "clean.py").write_text(
        "from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE\nimport json\n"
    )
    (package / "domain" / "events.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from iop_proto.v1 import runtime_pb2\n"
    )
    (package / "service.py").write_text(
        "def late():\n"
        "    import iop_proto.v1.runtime_pb2 as pb\n"
        "    return pb\n"
        "from iop_proto import v1\n"
        "from google.protobuf import json_format\n"
    )
    rim = frozenset({"adapters/", "bootstrap.py"})
    assert violations(package, rim) == [
        "iop_fake/domain/events.py:4",
        "iop_fake/service.py:2",
        "iop_fake/service.py:4",
        "iop_fake/service.py:5",
    ]
    assert (
        violations(package, frozenset({"adapters/", "bootstrap.py", "domain/", "service.py"})) == []
    )
