"""Compaction (``POST /v1/responses/compact``, and a response whose input ends with
Codex's ``compaction_trigger`` item) as pure functions: the summarising chat body a
conversation becomes, the ``compaction`` item that carries the summary back (and the
events of a compaction turn's stream), and that item read again when a later request
sends it as input.

The pool's own model writes the summary. The item's ``encrypted_content`` is opaque to
clients, as the specification has it; this server writes the summary there in base64
behind a version prefix (``COMPACTION_PREFIX``), and reads it back as a user message
("Summary of the conversation so far: ..."). A compaction item made elsewhere (OpenAI's,
encrypted with a key no engine here holds) is accepted and left out of the context.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from iop_edge.domain.events import Completed, Delta
from iop_edge.errors import EdgeError
from iop_edge.formats.responses_output import Turn, response_error, response_object
from iop_edge.formats.responses_stream import error_event_fields, sse_event

COMPACTION_PREFIX: Final = "iop-compaction-v1:"
SUMMARY_HEADER: Final = "Summary of the conversation so far:"
SUMMARY_MAX_TOKENS: Final = 1024
"""The summary's output cap unless the request asks ``max_output_tokens``."""
SUMMARY_INSTRUCTIONS: Final = (
    "You compact a conversation between a user and an AI assistant so that the assistant "
    "can continue it from your summary alone. Write a concise summary: the user's goals "
    "and requests, decisions made, what was done (tool calls and their results that "
    "matter: files, commands, errors), the current state, and what remains to do. Keep "
    "names, paths, numbers and identifiers exact. Write only the summary."
)
_ROLE_NAMES: Final = {"system": "System", "user": "User", "assistant": "Assistant"}
COMPACTION_TYPES: Final = frozenset({"compaction", "compaction_summary"})
"""Input item types of a compaction (Codex also reads the older ``compaction_summary``)."""
TRIGGER: Final = "compaction_trigger"
"""The input item that asks a response to be a compaction (Codex's remote compaction v2:
the conversation, then this item; the answer's one output item is the compaction)."""


def asks_compaction(body: Mapping[str, Any]) -> bool:
    """The request's input ends with a ``compaction_trigger`` item."""
    items = body.get("input")
    return (
        isinstance(items, list)
        and bool(items)
        and isinstance(items[-1], dict)
        and items[-1].get("type") == TRIGGER
    )


def compaction_id(run_id: str) -> str:
    return f"cmp_{run_id}"


class CompactionEvents:
    """Implements ``StreamWriter`` for a compaction turn: ``response.created`` and
    ``.in_progress``, then (the summary gathered, not streamed) the compaction item's
    ``response.output_item.added`` and ``.done``, and ``response.completed``."""

    __slots__ = ("_created", "_echo", "_run_id", "_seq", "_turn")

    def __init__(self, echo: dict[str, Any], run_id: str, created: int) -> None:
        self._echo = echo
        self._run_id = run_id
        self._created = created
        self._seq = 0
        self._turn = Turn()

    def opening(self) -> bytes:
        snapshot = self._response("in_progress", [])
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def delta(self, delta: Delta) -> bytes:
        self._turn.add(delta)
        return b""

    def closing(self, end: Completed) -> bytes:
        turn = self._turn
        turn.usage = end.usage or turn.usage
        item = compaction_item(compaction_id(self._run_id), "".join(turn.text))
        final = self._response("completed", [item], turn.usage_object())
        return b"".join(
            (
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed", response=final),
            )
        )

    def failure(self, error: EdgeError) -> bytes:
        final = self._response("failed", [], error=response_error(error))
        return self._event("error", **error_event_fields(error)) + self._event(
            "response.failed", response=final
        )

    settle: Final = None
    """Nothing is stored: the last events leave at once."""

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return response_object(
            self._echo,
            self._run_id,
            self._created,
            status=status,
            output=output,
            usage=usage,
            error=error,
            completed_at=int(time.time()) if status == "completed" else None,
        )

    def _event(self, kind: str, **fields: Any) -> bytes:
        seq = self._seq
        self._seq = seq + 1
        return sse_event(kind, seq, fields)


def summary_body(
    model: str, messages: Sequence[Mapping[str, Any]], max_tokens: int | None, stream: bool
) -> dict[str, Any]:
    """The chat body that has ``model`` summarise ``messages`` (a chat conversation):
    the conversation as one transcript, so every engine takes it whatever its tool
    support or chat template."""
    transcript = "\n\n".join(filter(None, (_line(message) for message in messages)))
    streamed = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    return {
        **streamed,
        "model": model,
        "messages": [
            {"role": "system", "content": SUMMARY_INSTRUCTIONS},
            {
                "role": "user",
                "content": f"The conversation:\n\n{transcript}\n\nWrite the summary now.",
            },
        ],
        "max_tokens": max_tokens or SUMMARY_MAX_TOKENS,
    }


def compaction_item(item_id: str, summary: str) -> dict[str, Any]:
    """The output item that carries ``summary``."""
    sealed = base64.b64encode(summary.encode()).decode()
    return {"type": "compaction", "id": item_id, "encrypted_content": COMPACTION_PREFIX + sealed}


def compaction_context(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat message a compaction input item becomes: its summary as a user message,
    or None for one this server did not make (nothing an engine here could read)."""
    content = item.get("encrypted_content")
    if not isinstance(content, str) or not content.startswith(COMPACTION_PREFIX):
        return None
    try:
        summary = base64.b64decode(content[len(COMPACTION_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return {"role": "user", "content": f"{SUMMARY_HEADER}\n{summary}"}


def _line(message: Mapping[str, Any]) -> str:
    role = message.get("role")
    text = _text(message.get("content"))
    if role == "tool":
        return f"Tool result ({message.get('tool_call_id', '')}): {text}"
    lines = [f"{_ROLE_NAMES.get(str(role), str(role))}: {text}"] if text else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        lines.append(
            f"Assistant called {function.get('name', '')} with {function.get('arguments', '')}"
        )
    return "\n".join(lines)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""
