"""The node behind its rim: protobuf is converted in the entrypoints (``entrypoints/wire.py``)
and nowhere else; the domain, the service layer and the adapters never import it."""

from __future__ import annotations

import ast
from pathlib import Path

import iop_node

ROOT = Path(iop_node.__file__).parent
ALLOWED = ("entrypoints/", "bootstrap.py")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_only_the_entrypoints_import_protobuf() -> None:
    modules = sorted(ROOT.rglob("*.py"))
    assert len(modules) > 20  # the package was found and walked
    outside = {
        str(path.relative_to(ROOT)): sorted(n for n in _imports(path) if "iop_proto.v1" in n)
        for path in modules
        if not str(path.relative_to(ROOT)).startswith(ALLOWED)
    }
    assert {name: found for name, found in outside.items() if found} == {}
    assert "iop_proto.v1" in str(_imports(ROOT / "entrypoints" / "wire.py"))  # the one place
