"""The credential store's contract, run against each backend (conftest's ``backend``):
a SQLite file and a real PostgreSQL database keep the same records by the same rules.

Moved from test_sqlite_store.py (which keeps what only a SQLite file has: its
journal mode, its file permissions, its migrations); nothing was dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest

from iop_control_plane.domain.credentials import hash_secret, new_api_key, new_node_token
from iop_control_plane.domain.key_limits import BudgetPeriod, KeyLimits
from iop_control_plane.domain.nodes import NodeState
from iop_control_plane.errors import CredentialError
from iop_control_plane.ports import CredentialStore, OpenedCredentialStore

Reopen = Callable[[], Awaitable[OpenedCredentialStore]]  # conftest's ``reopen`` fixture

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


async def test_the_store_satisfies_the_port(store: OpenedCredentialStore) -> None:
    port: CredentialStore = store  # mypy checks that each adapter satisfies the port
    assert port is store
    assert await store.list_node_tokens() == []
    assert await store.list_api_keys() == []


async def test_issued_token_is_found_by_the_hash_of_its_plaintext(
    store: OpenedCredentialStore,
) -> None:
    issued = new_node_token("gpu-1", NOW)
    await store.add_node_token(issued.token)
    assert await store.find_node_token(hash_secret(issued.plaintext)) == issued.token
    assert await store.find_node_token(hash_secret("iopnt_wrong")) is None


async def test_issued_key_is_found_with_its_policy(store: OpenedCredentialStore) -> None:
    issued = new_api_key("team-a", ["llama3", "qwen"], 3, NOW)
    await store.add_api_key(issued.key)
    found = await store.find_api_key(hash_secret(issued.plaintext))
    assert found == issued.key
    assert found is not None
    assert found.models == ("llama3", "qwen")
    assert found.created_at.tzinfo is not None


async def test_lists_are_oldest_first_and_include_revoked(store: OpenedCredentialStore) -> None:
    later = new_node_token("gpu-2", NOW + timedelta(seconds=1)).token
    earlier = new_node_token("gpu-1", NOW).token
    await store.add_node_token(later)
    await store.add_node_token(earlier)
    await store.revoke_node_token(earlier.token_id, NOW + timedelta(minutes=1))
    listed = await store.list_node_tokens()
    assert [t.token_id for t in listed] == [earlier.token_id, later.token_id]
    assert listed[0].revoked
    assert not listed[1].revoked

    keys = [new_api_key(f"k{i}", [], 0, NOW + timedelta(seconds=i)).key for i in range(3)]
    for key in reversed(keys):
        await store.add_api_key(key)
    assert await store.list_api_keys() == keys


async def test_revoke_keeps_the_first_time_and_is_seen_by_find(
    store: OpenedCredentialStore,
) -> None:
    token = new_node_token("gpu-1", NOW)
    key = new_api_key("team-a", [], 0, NOW)
    await store.add_node_token(token.token)
    await store.add_api_key(key.key)
    first, second = NOW + timedelta(minutes=1), NOW + timedelta(minutes=2)

    assert (await store.revoke_node_token(token.token.token_id, first)).revoked_at == first
    assert (await store.revoke_node_token(token.token.token_id, second)).revoked_at == first
    found_token = await store.find_node_token(token.token.secret_hash)
    assert found_token is not None
    assert found_token.revoked_at == first

    assert (await store.revoke_api_key(key.key.key_id, first)).revoked_at == first
    assert (await store.revoke_api_key(key.key.key_id, second)).revoked_at == first
    found_key = await store.find_api_key(key.key.secret_hash)
    assert found_key is not None
    assert found_key.revoked


async def test_revoking_an_unknown_id_is_a_credential_error(
    store: OpenedCredentialStore,
) -> None:
    with pytest.raises(CredentialError, match="tok_00000000"):
        await store.revoke_node_token("tok_00000000", NOW)
    with pytest.raises(CredentialError, match="key_00000000"):
        await store.revoke_api_key("key_00000000", NOW)


async def test_a_duplicate_is_a_credential_error(store: OpenedCredentialStore) -> None:
    token = new_node_token("gpu-1", NOW).token
    await store.add_node_token(token)
    with pytest.raises(CredentialError, match="already stored"):
        await store.add_node_token(token)


async def test_the_change_marker_moves_when_another_connection_writes(
    store: OpenedCredentialStore, reopen: Reopen
) -> None:
    before = await store.change_marker()
    assert await store.change_marker() == before  # stable while nothing happens

    cli = await reopen()  # a second process, as the CLI is
    try:
        issued = new_api_key("team-a", [], 0, NOW)
        await cli.add_api_key(issued.key)
    finally:
        await cli.aclose()

    after_insert = await store.change_marker()
    assert after_insert != before
    assert await store.find_api_key(issued.key.secret_hash) == issued.key

    other = await reopen()
    try:
        await other.revoke_api_key(issued.key.key_id, NOW)
    finally:
        await other.aclose()
    assert await store.change_marker() != after_insert


async def test_the_change_marker_moves_on_own_writes_only_when_something_changed(
    store: OpenedCredentialStore,
) -> None:
    before = await store.change_marker()
    token = new_node_token("gpu-1", NOW).token
    await store.add_node_token(token)
    added = await store.change_marker()
    assert added != before
    await store.revoke_node_token(token.token_id, NOW)
    revoked = await store.change_marker()
    assert revoked != added
    await store.revoke_node_token(token.token_id, NOW + timedelta(minutes=1))
    assert await store.change_marker() == revoked  # a repeat changes nothing


async def test_data_survives_reopening(reopen: Reopen) -> None:
    first = await reopen()
    issued = new_node_token("gpu-1", NOW)
    try:
        await first.add_node_token(issued.token)
    finally:
        await first.aclose()
    second = await reopen()
    try:
        assert await second.list_node_tokens() == [issued.token]
    finally:
        await second.aclose()


async def test_aclose_is_idempotent(reopen: Reopen) -> None:
    store = await reopen()
    await store.aclose()
    await store.aclose()


async def test_a_report_of_many_nodes_is_kept_whole(store: OpenedCredentialStore) -> None:
    """More nodes than one statement carries: every state is kept, the latest wins."""
    states = [NodeState(f"n{i}", "edge", True, "t", NOW, "", "", NOW) for i in range(1200)]
    await store.record_node_states(states)
    await store.record_node_states([NodeState("n7", "edge", False, "t", NOW, "", "gone", NOW)])
    kept = await store.node_states()
    assert len(kept) == 1200
    assert (kept["n7"].connected, kept["n7"].detail) == (False, "gone")
    assert kept["n1199"].connected


async def test_nodes_are_retired_admitted_and_their_states_kept(
    store: OpenedCredentialStore,
) -> None:
    """``node retire``/``node add``/``node list`` on each backend (the SQLite migration
    test checks the same on an upgraded file)."""
    assert await store.retired_nodes() == {}
    before = await store.change_marker()
    assert await store.retire_node("node-c", NOW) == NOW
    retired = await store.change_marker()
    assert retired != before  # a retirement changes the pushed config
    later = NOW.replace(year=NOW.year + 1)
    assert await store.retire_node("node-c", later) == NOW  # the first time is kept
    assert await store.change_marker() == retired  # and a repeat changes nothing
    assert await store.retired_nodes() == {"node-c": NOW}
    assert await store.unretire_node("node-c")
    assert not await store.unretire_node("node-c")
    assert await store.retired_nodes() == {}

    admitted = await store.change_marker()
    assert admitted != retired
    state = NodeState("node-c", "edge", True, "tok_1", NOW, "10.0.0.3:5000", "", NOW)
    await store.record_node_states([state])
    assert await store.node_states() == {"node-c": state}
    other = NodeState("node-d", "edge-2", True, "tok_2", None, "10.0.0.4:5000", "x", NOW)
    await store.record_node_states([other])
    await store.edge_lost("edge", later)
    states = await store.node_states()
    lost = states["node-c"]
    assert (lost.connected, lost.since, lost.reported_at) == (False, later, later)
    assert "edge edge lost its control link" in lost.detail
    assert states["node-d"] == other  # another edge's nodes are left as they were
    # Connection states are not configuration: no reload, no push for them.
    assert await store.change_marker() == admitted


async def test_a_keys_limits_are_kept_and_updated(store: OpenedCredentialStore) -> None:
    """Limits per key (issue 32): the key's own, per model, weight and priority, stored as
    issued, changed by ``update_api_key``, and never on a revoked or unknown key."""
    limits = KeyLimits(requests_per_minute=60, token_budget=10_000, budget_period=BudgetPeriod.DAY)
    issued = new_api_key("team-a", [], 2, NOW, limits=limits, weight=3, priority=5)
    await store.add_api_key(issued.key)
    assert await store.find_api_key(issued.key.secret_hash) == issued.key
    per_model = KeyLimits(output_tokens_per_minute=500, max_concurrent=1)
    wanted = dataclasses.replace(
        issued.key,
        limits=KeyLimits(input_tokens_per_minute=1000),
        model_limits=(("qwen", per_model),),
        weight=1,
        priority=-1,
        max_concurrent=4,
    )
    assert await store.update_api_key(wanted) == wanted
    assert await store.list_api_keys() == [wanted]
    ghost = new_api_key("ghost", [], 0, NOW).key
    with pytest.raises(CredentialError, match="no API key"):
        await store.update_api_key(ghost)
    await store.revoke_api_key(wanted.key_id, NOW)
    with pytest.raises(CredentialError, match="revoked"):
        await store.update_api_key(issued.key)
    [kept] = await store.list_api_keys()
    assert (kept.limits, kept.model_limits) == (wanted.limits, wanted.model_limits)
