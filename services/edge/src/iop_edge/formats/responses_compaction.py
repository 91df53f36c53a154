"""Compaction (``POST /v1/responses/compact``) as pure functions: the summarising chat
body a conversation becomes, the ``compaction`` item that carries the summary back, and
that item read again when a later request sends it as input.

The pool's own model writes the summary. The item's ``encrypted_content`` is opaque to
clients, as the specification has it; this server writes the summary there in base64
behind a version prefix (``COMPACTION_PREFIX``), and reads it back as a user message
("Summary of the conversation so far: ..."). A compaction item made elsewhere (OpenAI's,
encrypted with a key no engine here holds) is accepted and left out of the context.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any, Final

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


def summary_body(
    model: str, messages: Sequence[Mapping[str, Any]], max_tokens: int | None
) -> dict[str, Any]:
    """The chat body that has ``model`` summarise ``messages`` (a chat conversation):
    the conversation as one transcript, so every engine takes it whatever its tool
    support or chat template."""
    transcript = "\n\n".join(filter(None, (_line(message) for message in messages)))
    return {
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
