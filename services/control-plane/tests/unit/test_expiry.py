"""Expiry and rotation, pure: when a secret stops being accepted, what a node is told, and
what the edges are sent (the policy's expiry fields) at a given moment."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from iop_control_plane.adapters.fleet_proto import key_expiry_to_proto
from iop_control_plane.domain.authorization import Refusal, authorize
from iop_control_plane.domain.credentials import (
    accepts,
    expires_after,
    hash_secret,
    new_api_key,
    new_node_token,
    parse_duration,
    rotation_of,
)
from iop_control_plane.domain.fleet import parse_fleet
from iop_control_plane.errors import CredentialError

NOW = datetime(2026, 12, 1, tzinfo=UTC)
FLEET = parse_fleet({"models": [], "nodes": [{"id": "node-a"}]}, "test").spec


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30d", 30 * 86400), ("24h", 86400), ("90m", 5400), ("45s", 45), ("2w", 1209600),
     ("10", 10), ("1.5h", 5400), ("0", 0)],
)  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "-1h", "soon", "nan", "1y"])
def test_not_durations(text: str) -> None:
    with pytest.raises(CredentialError):
        parse_duration(text)


def test_an_expiry_must_be_in_the_future_and_given_once() -> None:
    assert expires_after(NOW, 60, None) == NOW + timedelta(minutes=1)
    assert expires_after(NOW, None, None) is None
    with pytest.raises(CredentialError, match="not in the future"):
        expires_after(NOW, None, NOW)
    with pytest.raises(CredentialError, match="not both"):
        expires_after(NOW, 60, NOW + timedelta(hours=1))


def test_a_key_is_accepted_until_its_expiry_and_not_at_it() -> None:
    key = new_api_key("a", [], 0, NOW, expires_at=NOW + timedelta(hours=1)).key
    assert accepts(key, key.secret_hash, NOW + timedelta(minutes=59))
    assert not accepts(key, key.secret_hash, NOW + timedelta(hours=1))
    assert not accepts(key, hash_secret("sk-iop-other"), NOW)


def test_the_previous_secret_ends_with_the_overlap_or_the_key_whichever_is_first() -> None:
    key = new_api_key("a", [], 0, NOW, expires_at=NOW + timedelta(hours=2)).key
    old = key.secret_hash
    long_overlap = rotation_of(key, False, "key", NOW, 3 * 3600)
    rotated = dataclasses.replace(key, secret_hash="new", rotation=long_overlap)
    assert accepts(rotated, old, NOW + timedelta(hours=1))
    assert not accepts(rotated, old, NOW + timedelta(hours=2))  # the key's own end comes first
    expires_ms, previous_hash, previous_ms = key_expiry_to_proto(rotated, NOW)
    assert previous_hash == old
    assert previous_ms == expires_ms == int((NOW + timedelta(hours=2)).timestamp() * 1000)
    # once the overlap is over, the edges are sent no previous secret at all
    assert key_expiry_to_proto(rotated, NOW + timedelta(hours=2))[1:] == ("", 0)


def test_an_expired_key_cannot_be_rotated() -> None:
    key = new_api_key("a", [], 0, NOW, expires_at=NOW + timedelta(hours=1)).key
    with pytest.raises(CredentialError, match="expired"):
        rotation_of(key, False, "API key k", NOW + timedelta(hours=1), 60)
    with pytest.raises(CredentialError, match="overlap"):
        rotation_of(key, False, "API key k", NOW, -1)


def test_an_expired_token_is_refused_as_expired() -> None:
    issued = new_node_token("node-a", NOW, expires_at=NOW + timedelta(days=1))
    token, presented = issued.token, hash_secret(issued.plaintext)
    ok = authorize("node-a", "node-a", token, FLEET, presented_hash=presented, now=NOW)
    assert ok.accepted
    later = NOW + timedelta(days=1)
    late = authorize("node-a", "node-a", token, FLEET, presented_hash=presented, now=later)
    assert late.refusal is Refusal.EXPIRED
    assert "expired" in late.reason


def test_a_rotated_token_takes_both_secrets_during_the_overlap_only() -> None:
    issued = new_node_token("node-a", NOW)
    old = hash_secret(issued.plaintext)
    rotation = rotation_of(issued.token, False, "token", NOW, 60)
    rotated = dataclasses.replace(issued.token, secret_hash="new", rotation=rotation)
    during, after = NOW + timedelta(seconds=59), NOW + timedelta(seconds=60)
    assert authorize("node-a", "node-a", rotated, FLEET, presented_hash=old, now=during).accepted
    refused = authorize("node-a", "node-a", rotated, FLEET, presented_hash=old, now=after)
    assert refused.refusal is Refusal.EXPIRED
    assert "previous secret" in refused.reason
    assert authorize("node-a", "node-a", rotated, FLEET, presented_hash="new", now=after).accepted
