"""The tools of a Responses request: read, offered to a chat-completions engine, and the
engine's calls named back as the client defined them.

Every engine of the pool runs chat completions, whose only tool is a function, so:

- a ``function`` tool is offered as it is;
- a ``namespace`` tool (a named group of function tools, as Codex sends its sub-agent
  tools) offers each inner function as ``<namespace>__<name>`` (trailing underscores of
  the namespace dropped first, so ``mcp__srv__`` gives ``mcp__srv__<name>``); a call comes
  back as a ``function_call`` item with the inner ``name`` and the ``namespace``, which is
  how Codex reads it, and such an item on input is flattened again;
- a ``custom`` tool (free-form input) is offered as a function of one string parameter,
  ``input``; the call comes back as a ``custom_tool_call`` item with that string. Its
  ``format``: a ``regex`` grammar becomes the parameter's JSON-schema ``pattern`` (engines
  that constrain tool arguments by their schema, llama.cpp and vLLM, then enforce it); a
  ``lark`` grammar has no JSON-schema form and a chat engine's ``grammar`` field would
  constrain the whole answer, not one argument, so it is put in the parameter's
  description for the model to follow, and not enforced;
- a hosted tool (``HOSTED``: web search, file search, code interpreter, MCP, computer
  use, image generation, local shell...) needs a service this pool does not run: it is
  accepted and left out of what the model is offered, and the answer names the dropped
  types in the ``x-iop-dropped-tools`` header. A ``tool_choice`` that names one is a 400.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.errors import InvalidRequest

HOSTED: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "tool_search",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
    }
)
"""Tool types that a hosted service runs (dated variants, ``web_search_2025_08_26``, too)."""
TOOL_CHOICES: Final = frozenset({"auto", "none", "required"})
CUSTOM_INPUT: Final = "input"
"""The one parameter a custom tool is offered with."""


def is_hosted(kind: str) -> bool:
    return kind in HOSTED or any(kind.startswith(f"{name}_20") for name in HOSTED)


def flat_name(name: str, namespace: str | None) -> str:
    """The name a chat engine sees for ``name`` in ``namespace``."""
    return name if not namespace else f"{namespace.rstrip('_')}__{name}"


@dataclass(frozen=True, slots=True)
class ToolRef:
    """What a name the engine called stands for."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools: as echoed, as offered, and what the engine's names stand for."""

    echo: list[dict[str, Any]] = field(default_factory=list)
    chat: list[dict[str, Any]] = field(default_factory=list)
    refs: dict[str, ToolRef] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()

    def ref(self, called: str) -> ToolRef:
        """What the engine's ``called`` name stands for (a function of that name if the
        request did not define it: the model's mistake is the client's to see)."""
        return self.refs.get(called) or ToolRef("function", called)


def read_tools(value: Any) -> Tools:
    """The ``tools`` array, checked; ``InvalidRequest`` naming the entry otherwise."""
    if value is None:
        return Tools()
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be an array.", param="tools")
    echo: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    refs: dict[str, ToolRef] = {}
    dropped: list[str] = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"'{where}' must be an object.", param=where)
        kind = tool.get("type")
        if kind == "function":
            entry = _function(tool, where)
            echo.append(entry)
            _offer(chat, refs, entry, ToolRef("function", entry["name"]), where)
        elif kind == "namespace":
            entry = _namespace(tool, where)
            echo.append(entry)
            for j, inner in enumerate(entry["tools"]):
                ref = ToolRef("function", inner["name"], entry["name"])
                _offer(chat, refs, inner, ref, f"{where}.tools[{j}]")
        elif kind == "custom":
            entry = _custom(tool, where)
            echo.append(entry)
            _offer(chat, refs, entry, ToolRef("custom", entry["name"]), where)
        elif isinstance(kind, str) and is_hosted(kind):
            if kind not in dropped:
                dropped.append(kind)
        else:
            raise InvalidRequest(
                f"Tools of type '{kind}' are not supported by this server: function, namespace "
                "and custom tools are, and hosted tools (web_search, file_search, ...) are "
                "accepted and dropped.",
                param=f"{where}.type",
            )
    return Tools(echo, chat, refs, tuple(dropped))


def read_tool_choice(value: Any, tools: Tools) -> tuple[Any, Any]:
    """``(echoed, chat)``: the choice as the Response repeats it and as the engine takes it."""
    if value is None:
        return "auto", "auto"
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value, value
    if not isinstance(value, dict):
        raise InvalidRequest(
            "'tool_choice' must be none, auto, required or an object naming a tool.",
            param="tool_choice",
        )
    kind = value.get("type")
    if kind in ("function", "custom"):
        name, namespace = value.get("name"), value.get("namespace")
        if not isinstance(name, str) or not (namespace is None or isinstance(namespace, str)):
            raise InvalidRequest("'tool_choice.name' must be a string.", param="tool_choice")
        called = flat_name(name, namespace)
        if called not in tools.refs and namespace is None:  # a namespaced one, named alone
            inner = [flat for flat, ref in tools.refs.items() if ref.name == name]
            called = inner[0] if len(inner) == 1 else called
        ref = tools.refs.get(called)
        if ref is None or ref.kind != kind:
            raise InvalidRequest(
                f"'tool_choice' names the {kind} tool {name!r}, which is not in 'tools'.",
                param="tool_choice",
            )
        return dict(value), {"type": "function", "function": {"name": called}}
    if kind == "allowed_tools":
        return _allowed(value, tools)
    if isinstance(kind, str) and is_hosted(kind):
        raise InvalidRequest(
            f"'tool_choice' names the hosted tool '{kind}', which this server does not run "
            "(hosted tools are dropped from what the model is offered).",
            param="tool_choice",
        )
    raise InvalidRequest(
        "'tool_choice' must be none, auto, required, or of type function, custom or allowed_tools.",
        param="tool_choice",
    )


def custom_arguments(text: str) -> str:
    """A custom tool call's input as the chat engine's function arguments."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The engine's function arguments for a custom tool as the free-form input (the
    arguments themselves when the model did not write the one-string object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(value[CUSTOM_INPUT])
    return arguments


# -- one tool --------------------------------------------------------------------------


def _function(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required.", param=f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(
            f"'{where}.parameters' must be an object.", param=f"{where}.parameters"
        )
    return {
        "type": "function",
        "name": name,
        "description": tool.get("description"),
        "parameters": parameters,
        "strict": tool.get("strict") if isinstance(tool.get("strict"), bool) else True,
    }


def _namespace(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required.", param=f"{where}.name")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise InvalidRequest(f"'{where}.tools' must be an array.", param=f"{where}.tools")
    functions = []
    for j, entry in enumerate(inner):
        at = f"{where}.tools[{j}]"
        if not isinstance(entry, dict) or entry.get("type", "function") != "function":
            raise InvalidRequest(
                f"'{at}' must be a function tool: a namespace groups function tools.",
                param=f"{at}.type",
            )
        functions.append(_function(entry, at))
    return {
        "type": "namespace",
        "name": name,
        "description": tool.get("description"),
        "tools": functions,
    }


def _custom(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required.", param=f"{where}.name")
    form = tool.get("format")
    if form is None:
        form = {"type": "text"}
    if not isinstance(form, dict) or form.get("type") not in ("text", "grammar"):
        raise InvalidRequest(
            f"'{where}.format.type' must be text or grammar.", param=f"{where}.format"
        )
    if form["type"] == "grammar" and not (
        form.get("syntax") in ("lark", "regex") and isinstance(form.get("definition"), str)
    ):
        raise InvalidRequest(
            f"'{where}.format' of type grammar needs a syntax (lark or regex) and a definition.",
            param=f"{where}.format",
        )
    return {
        "type": "custom",
        "name": name,
        "description": tool.get("description"),
        "format": dict(form),
    }


def _offer(
    chat: list[dict[str, Any]],
    refs: dict[str, ToolRef],
    entry: Mapping[str, Any],
    ref: ToolRef,
    where: str,
) -> None:
    called = flat_name(ref.name, ref.namespace)
    if called in refs:
        raise InvalidRequest(f"'{where}': a tool named {called!r} is defined twice.", param=where)
    refs[called] = ref
    function: dict[str, Any] = {"name": called}
    if entry.get("description"):
        function["description"] = entry["description"]
    if ref.kind == "custom":
        function["parameters"] = _custom_parameters(entry["format"])
    else:
        function["parameters"] = entry.get("parameters") or {"type": "object", "properties": {}}
        function["strict"] = entry["strict"]
    chat.append({"type": "function", "function": function})


def _custom_parameters(form: Mapping[str, Any]) -> dict[str, Any]:
    text: dict[str, Any] = {"type": "string", "description": "The tool's free-form input."}
    if form.get("type") == "grammar":
        if form["syntax"] == "regex":
            text["pattern"] = form["definition"]
        else:
            text["description"] = (
                "The tool's free-form input. It must match this Lark grammar:\n"
                + form["definition"]
            )
    return {
        "type": "object",
        "properties": {CUSTOM_INPUT: text},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }


def _allowed(value: Mapping[str, Any], tools: Tools) -> tuple[Any, Any]:
    """``allowed_tools``: the engine is offered only the listed tools, in the mode asked."""
    mode = value.get("mode", "auto")
    listed = value.get("tools")
    if mode not in ("auto", "required") or not isinstance(listed, list):
        raise InvalidRequest(
            "'tool_choice' of type allowed_tools needs a mode (auto or required) and tools.",
            param="tool_choice",
        )
    names: list[str] = []
    for entry in listed:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if isinstance(kind, str) and is_hosted(kind):
            continue  # dropped with the tool itself
        name = entry.get("name") if isinstance(entry, dict) else None
        namespace = entry.get("namespace") if isinstance(entry, dict) else None
        called = flat_name(name, namespace) if isinstance(name, str) else ""
        if called not in tools.refs:
            raise InvalidRequest(
                f"'tool_choice.tools' names {name!r}, which is not in 'tools'.",
                param="tool_choice",
            )
        names.append(called)
    return dict(value), {"mode": mode, "names": names}


def restricted(chat_tools: Sequence[dict[str, Any]], choice: Any) -> tuple[list[Any], Any]:
    """The chat tools and tool choice once an ``allowed_tools`` choice is applied."""
    if isinstance(choice, dict) and "names" in choice:
        allowed = set(choice["names"])
        return [t for t in chat_tools if t["function"]["name"] in allowed], choice["mode"]
    return list(chat_tools), choice
