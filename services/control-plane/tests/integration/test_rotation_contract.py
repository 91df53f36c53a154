"""Expiry and rotation in the credential store's contract, on each backend (SQLite and a
real PostgreSQL): what is stored comes back, and a rotated credential is found by its
new secret and, during the overlap, by its previous one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from iop_control_plane.domain.credentials import (
    accepts,
    hash_secret,
    new_api_key,
    new_node_token,
    new_secret,
    rotation_of,
)
from iop_control_plane.errors import CredentialError
from iop_control_plane.ports import OpenedCredentialStore

from .test_store_contract import Reopen

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


async def test_expiry_is_kept_and_read_back(store: OpenedCredentialStore, reopen: Reopen) -> None:
    token = new_node_token("gpu-1", NOW, expires_at=NOW + 30 * DAY).token
    key = new_api_key("team-a", [], 0, NOW, expires_at=NOW + DAY).key
    never = new_api_key("team-b", [], 0, NOW + timedelta(seconds=1)).key  # listed second
    await store.add_node_token(token)
    await store.add_api_key(key)
    await store.add_api_key(never)
    again = await reopen()
    try:
        assert [t.expires_at for t in await again.list_node_tokens()] == [NOW + 30 * DAY]
        assert [k.expires_at for k in await again.list_api_keys()] == [NOW + DAY, None]
    finally:
        await again.aclose()


async def test_a_rotated_key_is_found_by_both_secrets_until_the_overlap_ends(
    store: OpenedCredentialStore,
) -> None:
    issued = new_api_key("team-a", ["qwen"], 2, NOW, expires_at=NOW + 30 * DAY)
    await store.add_api_key(issued.key)
    marker = await store.change_marker()
    rotation = rotation_of(issued.key, False, "key", NOW + DAY, 3600)
    plaintext, secret_hash = new_secret("sk-iop-")
    rotated = await store.rotate_api_key(issued.key.key_id, secret_hash, rotation)

    assert await store.change_marker() != marker
    assert rotated.key_id == issued.key.key_id
    assert (rotated.models, rotated.max_concurrent) == (("qwen",), 2)  # the same policy
    assert rotated.secret_hash == hash_secret(plaintext)
    assert rotated.expires_at == NOW + 30 * DAY
    old_hash = hash_secret(issued.plaintext)
    assert await store.find_api_key(secret_hash) == rotated
    assert await store.find_api_key(old_hash) == rotated  # found by the previous secret
    overlap_end = NOW + DAY + timedelta(hours=1)
    assert rotated.rotation is not None
    assert rotated.rotation.until == overlap_end
    assert accepts(rotated, old_hash, overlap_end - timedelta(seconds=1))
    assert not accepts(rotated, old_hash, overlap_end)
    assert accepts(rotated, secret_hash, overlap_end)
    assert not accepts(rotated, secret_hash, NOW + 30 * DAY)


async def test_a_rotated_token_is_found_by_both_secrets(store: OpenedCredentialStore) -> None:
    issued = new_node_token("gpu-1", NOW)
    await store.add_node_token(issued.token)
    rotation = rotation_of(issued.token, False, "token", NOW, 60)
    _, secret_hash = new_secret("iopnt_")
    rotated = await store.rotate_node_token(issued.token.token_id, secret_hash, rotation)
    assert await store.find_node_token(secret_hash) == rotated
    assert await store.find_node_token(hash_secret(issued.plaintext)) == rotated
    assert [t.rotation for t in await store.list_node_tokens()] == [rotated.rotation]


async def test_a_stale_or_revoked_rotation_is_refused(store: OpenedCredentialStore) -> None:
    issued = new_api_key("team-a", [], 0, NOW)
    await store.add_api_key(issued.key)
    first = rotation_of(issued.key, False, "key", NOW, 60)
    await store.rotate_api_key(issued.key.key_id, new_secret("sk-iop-")[1], first)
    # a second rotation made from the same (now previous) secret lost the race
    with pytest.raises(CredentialError, match="meanwhile"):
        await store.rotate_api_key(issued.key.key_id, new_secret("sk-iop-")[1], first)
    [current] = await store.list_api_keys()
    await store.revoke_api_key(issued.key.key_id, NOW)
    with pytest.raises(CredentialError, match="revoked"):
        rotation_of(current.revoke(NOW), True, "key", NOW, 60)
    late = rotation_of(current, False, "key", NOW, 60)
    with pytest.raises(CredentialError, match="meanwhile"):
        await store.rotate_api_key(issued.key.key_id, new_secret("sk-iop-")[1], late)
    token = new_node_token("gpu-1", NOW)
    with pytest.raises(CredentialError):
        await store.rotate_node_token(
            token.token.token_id,
            new_secret("iopnt_")[1],
            rotation_of(token.token, False, "t", NOW, 0),
        )
