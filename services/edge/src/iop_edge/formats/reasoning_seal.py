"""A model's reasoning sealed into a Responses ``encrypted_content``, and opened again.

A stateless client (``store: false``, ``include: ["reasoning.encrypted_content"]``, as
Codex sends) keeps a response's reasoning only as the opaque ``encrypted_content`` of a
``reasoning`` item and sends it back with its next turn. The edge seals the reasoning
text with AES-GCM under a key only the edges hold (``EdgeSettings.reasoning_key_file``;
every edge of a fleet given the same file opens what another sealed), so what comes back
is the edge's own text, unaltered. Anything else (OpenAI's own ciphertext, another
fleet's, a tampered one) does not open, and the item is then skipped, never refused.

Pure computation, no I/O: the key is read by the bootstrap.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX: Final = "iop1."
"""Marks the format (and its version) of what this edge seals."""
KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
_AAD: Final = b"iop-edge reasoning encrypted_content v1"


class ReasoningSeal:
    """Seals reasoning text for a client to hold, and opens what an edge sealed."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a reasoning key has {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)

    @classmethod
    def generate(cls) -> ReasoningSeal:
        """A seal with a fresh random key: what it seals opens in this process only."""
        return cls(os.urandom(KEY_BYTES))

    def seal(self, text: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, text.encode(), _AAD)
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def open(self, token: str) -> str | None:
        """The reasoning text, or None when ``token`` is not one an edge of this key sealed."""
        if not token.startswith(PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(token[len(PREFIX) :])
            if len(raw) <= NONCE_BYTES:
                return None
            plain = self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], _AAD)
            return plain.decode()
        except (InvalidTag, binascii.Error, ValueError):
            return None


def parse_key(text: str) -> bytes:
    """A key file's content: 64 hex digits or the base64 of 32 bytes (``openssl rand
    -hex 32`` writes the first)."""
    value = text.strip()
    try:
        key = bytes.fromhex(value) if len(value) == 2 * KEY_BYTES else base64.b64decode(value)
    except (ValueError, binascii.Error):
        raise ValueError("a reasoning key is 64 hex digits or base64 of 32 bytes") from None
    if len(key) != KEY_BYTES:
        raise ValueError("a reasoning key is 64 hex digits or base64 of 32 bytes")
    return key
