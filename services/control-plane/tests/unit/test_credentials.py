"""Secrets are random, prefixed and shown once; what is kept is their SHA-256 and the policy."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest

from iop_control_plane.domain.credentials import (
    API_KEY_PREFIX,
    NODE_TOKEN_PREFIX,
    ApiKey,
    as_utc,
    hash_secret,
    new_api_key,
    new_node_token,
)
from iop_control_plane.errors import ControlPlaneError, CredentialError

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
URLSAFE_32_BYTES = r"[A-Za-z0-9_-]{43}"


def test_hash_secret_is_sha256_hex_of_utf8() -> None:
    assert hash_secret("sk-iop-abc") == hashlib.sha256(b"sk-iop-abc").hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", hash_secret("x"))


def test_node_token_has_prefix_random_secret_and_stores_only_its_hash() -> None:
    issued = new_node_token("gpu-1", NOW)
    assert re.fullmatch(re.escape(NODE_TOKEN_PREFIX) + URLSAFE_32_BYTES, issued.plaintext)
    assert re.fullmatch(r"tok_[0-9a-f]{8}", issued.token.token_id)
    assert issued.token.node_id == "gpu-1"
    assert issued.token.secret_hash == hash_secret(issued.plaintext)
    assert issued.token.created_at == NOW
    assert not issued.token.revoked


def test_api_key_has_openai_like_prefix_and_keeps_its_policy() -> None:
    issued = new_api_key("team-a", ["llama3", "qwen"], 4, NOW)
    assert re.fullmatch(re.escape(API_KEY_PREFIX) + URLSAFE_32_BYTES, issued.plaintext)
    assert issued.plaintext.startswith("sk-")
    assert re.fullmatch(r"key_[0-9a-f]{8}", issued.key.key_id)
    assert issued.key.secret_hash == hash_secret(issued.plaintext)
    assert issued.key.models == ("llama3", "qwen")
    assert issued.key.max_concurrent == 4


def test_secrets_and_ids_differ_every_time() -> None:
    tokens = [new_node_token("n", NOW) for _ in range(50)]
    assert len({t.plaintext for t in tokens}) == 50
    assert len({t.token.token_id for t in tokens}) == 50


def test_repr_never_shows_the_plaintext_or_the_hash() -> None:
    token = new_node_token("gpu-1", NOW)
    key = new_api_key("team-a", [], 0, NOW)
    for issued, plaintext, digest in (
        (token, token.plaintext, token.token.secret_hash),
        (key, key.plaintext, key.key.secret_hash),
    ):
        assert plaintext not in repr(issued)
        assert digest not in repr(issued)


def test_model_names_are_stripped_and_deduplicated_in_order() -> None:
    key = new_api_key("  team-a ", [" qwen", "llama3", "qwen "], 0, NOW).key
    assert key.name == "team-a"
    assert key.models == ("qwen", "llama3")


def test_empty_models_allow_every_model() -> None:
    everything = new_api_key("a", [], 0, NOW).key
    limited = new_api_key("b", ["llama3"], 0, NOW).key
    assert everything.allows_model("anything")
    assert limited.allows_model("llama3")
    assert not limited.allows_model("qwen")


@pytest.mark.parametrize("node_id", ["", "   "])
def test_node_token_needs_a_node_id(node_id: str) -> None:
    with pytest.raises(CredentialError, match="node id"):
        new_node_token(node_id, NOW)


@pytest.mark.parametrize(
    ("name", "models", "max_concurrent", "message"),
    [
        ("", [], 0, "needs a name"),
        ("a", ["llama3", " "], 0, "empty model name"),
        ("a", [], -1, "max_concurrent must be 0"),
    ],
)
def test_api_key_arguments_are_validated(
    name: str, models: list[str], max_concurrent: int, message: str
) -> None:
    with pytest.raises(CredentialError, match=message) as caught:
        new_api_key(name, models, max_concurrent, NOW)
    assert isinstance(caught.value, ControlPlaneError)


def test_a_bare_string_of_models_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        new_api_key("a", "llama3", 0, NOW)


def test_timestamps_are_utc_and_naive_ones_are_refused() -> None:
    paris = timezone(timedelta(hours=1))
    issued = new_node_token("n", datetime(2025, 3, 1, 13, 0, tzinfo=paris))
    assert issued.token.created_at == NOW
    assert issued.token.created_at.tzinfo is UTC
    with pytest.raises(ValueError, match="no time zone"):
        as_utc(datetime(2025, 3, 1, 12, 0))  # naive on purpose


def test_revoking_twice_keeps_the_first_time() -> None:
    key: ApiKey = new_api_key("a", [], 0, NOW).key
    first = key.revoke(NOW + timedelta(minutes=1))
    again = first.revoke(NOW + timedelta(minutes=2))
    assert first.revoked
    assert again.revoked_at == NOW + timedelta(minutes=1)
    assert not key.revoked  # records are frozen: revoke returns a copy
