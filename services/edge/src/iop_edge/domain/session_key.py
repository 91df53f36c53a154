"""The session a request belongs to, from what coding agents already send
(docs/ARCHITECTURE.md#cache-affinity).

Every turn of an agent resends its conversation; the turn is cheap only on the engine
that served the previous one. Agents name their session, each its own way, and none of
them needs to be told about IOP:

- opencode: the ``x-session-affinity`` and ``x-session-id`` headers;
- Codex CLI: the ``session-id`` header (SSE and the WebSocket handshake) and
  ``prompt_cache_key`` (its thread id);
- Claude Code: the ``X-Claude-Code-Session-Id`` header, and ``metadata.user_id`` (a JSON
  text with ``session_id``);
- any client: the ``x-session-id`` header, OpenAI's ``prompt_cache_key``;
- the Responses API: ``previous_response_id``, each turn naming the last;
- OpenAI clients: ``safety_identifier``, ``user`` (an end user: coarser, taken last).

The first one present wins, in the order of ``HEADERS`` then the body's fields. The key
is scoped to the API key that sent it (``key_id``): a client cannot steer another key's
sessions, nor learn anything from where its own land.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

HEADERS: Final = (
    "x-session-affinity",  # opencode's, meant for exactly this
    "x-session-id",  # opencode's, and the generic one
    "session-id",  # Codex CLI
    "session_id",  # Codex CLI before 0.1xx
    "x-claude-code-session-id",  # Claude Code
)
"""Header names read, in order (aiohttp's headers are case-insensitive)."""

MAX_KEY_CHARS: Final = 200
"""A longer value is cut: a key only needs to tell sessions apart."""

RESPONSE_PREFIX: Final = "response:"
"""Keys of the Responses chain: ``response:<id of the previous response>``. The
dispatcher remembers each response's provider under ``response:<its id>``."""


def session_key(
    headers: Mapping[str, str], body: Mapping[str, Any], key_id: str = ""
) -> str | None:
    """The session of a request, scoped to ``key_id``; ``None`` when it names none."""
    found: str | None = None
    for name in HEADERS:
        value = headers.get(name)
        if value:
            found = value.strip()
            break
    else:  # no header names one: the body's fields, in order
        cache_key = body.get("prompt_cache_key")
        metadata = body.get("metadata")
        previous = body.get("previous_response_id")
        if isinstance(cache_key, str) and cache_key:
            found = cache_key
        elif metadata and (claude := _claude_session(metadata)):
            found = claude
        elif isinstance(previous, str) and previous:
            found = RESPONSE_PREFIX + previous
        else:
            for field in ("safety_identifier", "user"):
                value = body.get(field)
                if isinstance(value, str) and value:
                    found = f"{field}:{value}"
                    break
    if not found:
        return None
    return f"{key_id}\x00{found[:MAX_KEY_CHARS]}"


def successor_key(run_id: str, key_id: str = "") -> str:
    """The key a Responses request naming this run's response as its
    ``previous_response_id`` reads: the response's id is ``resp_<run id>``
    (``formats.responses_output.response_id``)."""
    return f"{key_id}\x00{(RESPONSE_PREFIX + 'resp_' + run_id)[:MAX_KEY_CHARS]}"


def _claude_session(metadata: Any) -> str | None:
    """Claude Code's ``metadata.user_id``: a JSON text with ``session_id`` (2.x), or
    ``user_<hash>_account_<id>_session_<uuid>`` (1.x); another client's user id as is."""
    if not isinstance(metadata, Mapping):
        return None
    user_id = metadata.get("user_id")
    if not isinstance(user_id, str) or not user_id:
        return None
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return user_id
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session if isinstance(session, str) and session else user_id
    _, marker, session = user_id.rpartition("_session_")
    return session if marker and session else user_id
