"""Prompt prefixes as chains of block hashes, the same on the edge and the node.

An engine's prompt cache (llama.cpp's slots and host prompt cache, vLLM's and SGLang's
prefix caching) saves the prefill of the longest prefix of a prompt it has seen. The edge
guesses where a prefix lives from what it sent where, and the node reports what its
engine served; both must name a prefix the same way, so the rule lives here, beside the
wire contract, and both import it.

A prompt's **text** is what the engine's chat template renders, in order, without the
template: the tools (canonical JSON: one tool list renders one way), then each message's
role and content, text parts joined. Its UTF-8 bytes are cut into blocks of
``BLOCK_CHARS`` bytes; block ``i``'s hash is the hash of every byte up to the end of
block ``i``, so a hash names the whole prefix (as vLLM's block hashes do over token ids).
The last, partial block has no hash: a prefix is matched in whole blocks. The body is the
one the run carries (the edge's ``RunOrder.body_json``, the node's ``ExecutionSpec.body``):
the dialects have already dropped the per-request noise agents put in their prompts
(Claude Code's billing header), so two turns of one conversation share their prefix.

Bytes, not tokens: neither side has the engine's tokenizer at hand, and a block of 256
bytes is 50-80 tokens of English or code, fine enough to tell a shared system prompt from
a shared conversation. Cost: about 0.5 ms for Claude Code's 76 KB first request (one
incremental BLAKE2b over the text, a copy per block), paid only where there is a choice
to make (a model with more than one provider).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

import orjson

BLOCK_CHARS: Final = 256
"""Bytes per block (about 60 tokens, a fraction of one agent turn); ASCII text has as many
characters."""

MAX_BLOCKS: Final = 2048
"""Blocks hashed at most (512 KiB): longer prompts are matched on this much of
their start, which already tells their engine apart; the bound keeps hashing cheap."""

_SEPARATOR: Final = "\x1e"  # between messages; a record separator no chat text carries


def body_blocks(body: Mapping[str, Any]) -> list[int]:
    """A run body's prefix chain: the prefix hashes of its prompt text's whole blocks (at
    most ``MAX_BLOCKS``), element ``i`` naming the text's first ``(i + 1) * BLOCK_CHARS``
    bytes of UTF-8; ``[]`` for a body with nothing to cache (embeddings).

    The text (see the module's docstring) is what an engine's prompt starts with, in
    order; it exists only to be hashed, so it is made and hashed here, in one place.
    """
    prompt = body.get("prompt")
    messages = body.get("messages")
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        text = _SEPARATOR.join(prompt)
    elif not isinstance(messages, list):
        return []
    else:
        parts: list[str] = []
        tools = body.get("tools")
        if tools:
            parts.append("tools:" + _canonical(tools))
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, str):
                said = content
            elif isinstance(content, list):
                said = "".join(_part_text(part) for part in content)
            else:
                said = ""
            calls = message.get("tool_calls")
            if calls:  # an assistant turn that called tools renders the calls
                said += _canonical(calls)
            parts.append(f"{message.get('role', '')}:{said}")
        text = _SEPARATOR.join(parts)
    raw = memoryview(text.encode("utf-8", "surrogatepass"))
    whole = min(len(raw) // BLOCK_CHARS, MAX_BLOCKS)
    running = hashlib.blake2b(digest_size=8)
    hashes: list[int] = []
    for start in range(0, whole * BLOCK_CHARS, BLOCK_CHARS):
        running.update(raw[start : start + BLOCK_CHARS])
        hashes.append(int.from_bytes(running.copy().digest(), "big"))
    return hashes


def _part_text(part: object) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        text = part.get("text")
        if isinstance(text, str):
            return text
        # An image or file part: its kind and reference, so the hash moves with it.
        return _canonical(part)[:BLOCK_CHARS]
    return ""


def _canonical(value: object) -> str:
    """JSON with sorted keys: one value, one text, whatever order the client wrote."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # what orjson refuses (integers past 64 bits ...): the slow way
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def longest_match(chain: Iterable[int], held: Mapping[int, int]) -> int:
    """How many leading blocks of ``chain`` a holder of the prefixes ``held`` (a prefix's
    last hash -> its length in blocks) has: the longest held prefix that ``chain`` starts
    with, 0 for none."""
    best = 0
    for length, block in enumerate(chain, start=1):
        if held.get(block) == length:
            best = length
    return best
