"""Which functions on a request's path write the body's ``model``: read from their source.

The hops tool reports how many times ``model`` is set in the request body on its way
to the provider (issue 15: "rewritten three times: edge, node router, adapter"). The
functions that do it are found in the source of each function on the path, not from
a list of names, so the same rule holds after code moves. A function counts as a
rewriter when its own body (not a function nested in it) does one of:

- assigns a ``"model"`` item: ``body["model"] = target`` (also ``+=`` and annotated);
- calls ``.update(model=...)``;
- joins a string or bytes constant holding ``"model":`` (directly or through a
  module-level constant: ``_MODEL_KEY = b'{"model":'``) into a new value, with ``+``,
  ``%`` or a ``join`` / ``replace`` / ``format`` call: a body written as bytes with its
  model spliced in (``len(_MODEL_KEY)`` is a size, not a write).

Building a *response* with a ``"model"`` key in a dict display is not a rewrite of
the request body and is not matched (the streamed chunks' envelope is one).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

_MARK = '"model":'
_SPLICES = frozenset({"join", "replace", "format"})
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class _Module:
    tree: ast.Module
    constants: dict[str, object]  # module-level NAME = <str or bytes constant>


@functools.cache
def _module(file: str) -> _Module | None:
    try:
        tree = ast.parse(Path(file).read_text(), file)
    except (OSError, SyntaxError, ValueError):
        return None
    constants: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str | bytes):
            for target in targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = value.value
    return _Module(tree, constants)


def _function_at(tree: ast.Module, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function whose code starts at ``line`` (its ``def``, or its first decorator)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if line in (node.lineno, first):
                return node
    return None


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """Every node of ``function``'s body, without descending into nested definitions."""
    found: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, _NESTED):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def _holds_mark(value: object) -> bool:
    if isinstance(value, bytes):
        return _MARK.encode() in value
    return isinstance(value, str) and _MARK in value


def _writes_model(node: ast.AST, constants: dict[str, object]) -> bool:
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(
            isinstance(t, ast.Subscript)
            and isinstance(t.slice, ast.Constant)
            and t.slice.value == "model"
            for t in targets
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        return _marked(node.left, constants) or _marked(node.right, constants)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "update":
            return any(k.arg == "model" for k in node.keywords)
        if node.func.attr in _SPLICES:
            parts = [node.func.value, *node.args]
            parts += [e for a in node.args if isinstance(a, ast.List | ast.Tuple) for e in a.elts]
            return any(_marked(part, constants) for part in parts)
    return False


def _marked(node: ast.AST, constants: dict[str, object]) -> bool:
    """Whether ``node`` is a constant (or a module constant's name) holding the mark."""
    if isinstance(node, ast.Constant):
        return _holds_mark(node.value)
    if isinstance(node, ast.Name):
        return _holds_mark(constants.get(node.id))
    return False


def model_writes(file: str, line: int) -> list[int]:
    """Lines of the function defined at ``file``:``line`` that set a body's ``model``."""
    module = _module(file)
    if module is None:
        return []
    function = _function_at(module.tree, line)
    if function is None:
        return []
    lines = {
        getattr(node, "lineno", function.lineno)
        for node in _own_nodes(function)
        if _writes_model(node, module.constants)
    }
    return sorted(lines)
