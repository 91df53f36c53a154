"""What the edges are sent about expiring keys, and when: the fleet authority over a real
SQLite store, its clock stepped past a key's expiry with no change in the store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from iop_control_plane.adapters.fleet_proto import EXPIRED_LISTED_S
from iop_control_plane.adapters.sqlite_store import SqliteCredentialStore
from iop_control_plane.authority import FleetAuthority
from iop_control_plane.domain.credentials import new_api_key, new_node_token
from iop_control_plane.metrics import ControlPlaneMetrics

NOW = datetime(2026, 12, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = NOW.timestamp()

    def __call__(self) -> float:
        return self.now


async def test_an_expired_key_leaves_the_pushed_keys_at_its_moment(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"models": [], "nodes": [{"id": "node-a"}]}))
    store = await SqliteCredentialStore.open(tmp_path / "cp.db")
    registry = CollectorRegistry()
    clock = Clock()
    try:
        expiring = new_api_key("short", [], 0, NOW, expires_at=NOW + timedelta(hours=1)).key
        lasting = new_api_key("long", [], 0, NOW).key
        token = new_node_token("node-a", NOW, expires_at=NOW + timedelta(days=30)).token
        for key in (expiring, lasting):
            await store.add_api_key(key)
        await store.add_node_token(token)
        authority = FleetAuthority(fleet, store, ControlPlaneMetrics.create(registry), clock)
        pushed = []

        async def listener(snapshot: object) -> None:
            pushed.append(snapshot)

        authority.subscribe(listener)
        await authority.start()
        policies = {k.key_id: k for k in authority.snapshot.api_keys}
        assert policies[expiring.key_id].expires_unix_ms == int(
            (NOW + timedelta(hours=1)).timestamp() * 1000
        )
        assert policies[lasting.key_id].expires_unix_ms == 0
        gauge = "iop_credential_expiry_timestamp_seconds"
        expiry_of = registry.get_sample_value
        assert (
            expiry_of(gauge, {"kind": "api_key", "id": expiring.key_id})
            == (NOW + timedelta(hours=1)).timestamp()
        )
        assert (
            expiry_of(gauge, {"kind": "node_token", "id": token.token_id})
            == (NOW + timedelta(days=30)).timestamp()
        )
        assert expiry_of(gauge, {"kind": "api_key", "id": lasting.key_id}) is None

        clock.now += 3599
        assert not await authority.refresh_credentials()  # nothing changed, nothing expired
        clock.now += 1
        assert await authority.refresh_credentials()  # the moment passed: pushed again
        assert [k.key_id for k in pushed[-1].api_keys] == [lasting.key_id]
        [expired] = pushed[-1].expired_keys
        assert (expired.key_id, expired.key_hash) == (expiring.key_id, expiring.secret_hash)
    finally:
        await store.aclose()


async def test_keys_stay_required_once_one_was_issued(tmp_path: Path) -> None:
    """``keys_required``: false in a fleet that never had a key, true from the first key on,
    also when the last one is revoked or expired past the week it is listed as expired
    (the edges would otherwise open the API to loopback clients)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"models": [], "nodes": [{"id": "node-a"}]}))
    store = await SqliteCredentialStore.open(tmp_path / "cp.db")
    clock = Clock()
    try:
        metrics = ControlPlaneMetrics.create(CollectorRegistry())
        authority = FleetAuthority(fleet, store, metrics, clock)
        await authority.start()
        assert not authority.snapshot.keys_required

        revoked = new_api_key("revoked", [], 0, NOW).key
        expiring = new_api_key("short", [], 0, NOW, expires_at=NOW + timedelta(hours=1)).key
        await store.add_api_key(revoked)
        assert await authority.refresh_credentials()
        assert authority.snapshot.keys_required
        await store.revoke_api_key(revoked.key_id, NOW)
        await store.add_api_key(expiring)
        assert await authority.refresh_credentials()
        assert [k.key_id for k in authority.snapshot.api_keys] == [expiring.key_id]

        clock.now += 3600  # the last live key expires: listed as expired ...
        assert await authority.refresh_credentials()
        assert not authority.snapshot.api_keys
        assert [e.key_id for e in authority.snapshot.expired_keys] == [expiring.key_id]
        assert authority.snapshot.keys_required
        clock.now += EXPIRED_LISTED_S  # ... then no longer: no key is sent at all
        assert await authority.refresh_credentials()
        assert not authority.snapshot.api_keys
        assert not authority.snapshot.expired_keys
        assert authority.snapshot.keys_required
    finally:
        await store.aclose()
