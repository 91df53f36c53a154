"""The edge's side of expiry and rotation: the policy from the control-plane (protobuf) as
the key ring holds it, and what ``authenticate`` answers for each secret at a moment."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.entrypoints.api_auth import access_mode, authenticate, check_open_access
from iop_edge.errors import AuthenticationFailed, ControlPlaneUnavailable, KeyExpired
from iop_edge.service.fleet_holder import FleetHolder
from iop_proto.v1 import runtime_pb2 as pb


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class Request:
    """An ``ApiRequest`` with headers only: all ``authenticate`` reads."""

    headers: Mapping[str, str] = field(default_factory=dict)
    method: str = "POST"
    path: str = "/v1/chat/completions"
    remote: str | None = "10.0.0.2"
    body_exists: bool = False
    content: object = None


def bearer(secret: str) -> Request:
    return Request(headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture
def ring() -> FleetHolder:
    now_ms = int(time.time() * 1000)
    hour = 3_600_000
    config = pb.FleetConfig(
        version=1,
        api_keys=[
            pb.ApiKeyPolicy(key_id="key_live", name="live", key_hash=digest("sk-iop-live")),
            pb.ApiKeyPolicy(
                key_id="key_rot",
                name="rotated",
                key_hash=digest("sk-iop-new"),
                models=["qwen"],
                expires_unix_ms=now_ms + hour,
                previous_key_hash=digest("sk-iop-old"),
                previous_expires_unix_ms=now_ms + hour // 2,
            ),
            pb.ApiKeyPolicy(
                key_id="key_past",
                name="past",
                key_hash=digest("sk-iop-past"),
                expires_unix_ms=now_ms - 1,  # arrived just after its moment: refused anyway
            ),
        ],
        expired_keys=[
            pb.ExpiredKey(
                key_id="key_gone", key_hash=digest("sk-iop-gone"), expired_unix_ms=now_ms - hour
            )
        ],
    )
    return FleetHolder(fleet_from_proto(config))


def test_a_rotated_key_is_one_key_with_two_secrets(ring: FleetHolder) -> None:
    new = authenticate(bearer("sk-iop-new"), ring)
    old = authenticate(bearer("sk-iop-old"), ring)
    assert new is not None
    assert old is not None
    assert (new.key_id, new.models) == (old.key_id, old.models) == ("key_rot", frozenset({"qwen"}))
    assert old.expires_ms < new.expires_ms  # the old secret ends with the overlap
    live = authenticate(bearer("sk-iop-live"), ring)
    assert live is not None
    assert live.expires_ms == 0


@pytest.mark.parametrize("secret", ["sk-iop-past", "sk-iop-gone"])
def test_an_expired_secret_is_refused_saying_so(ring: FleetHolder, secret: str) -> None:
    with pytest.raises(KeyExpired) as refused:
        authenticate(bearer(secret), ring)
    assert refused.value.status == 401
    assert refused.value.code == "invalid_api_key"
    assert "expired at" in refused.value.message


def test_an_unknown_secret_is_still_only_unknown(ring: FleetHolder) -> None:
    with pytest.raises(AuthenticationFailed) as refused:
        authenticate(bearer("sk-iop-never"), ring)
    assert not isinstance(refused.value, KeyExpired)
    assert refused.value.message == "Incorrect API key provided."


def test_an_edge_whose_only_key_expired_is_not_open() -> None:
    """The push that moves the last key to the expired list leaves keys required: the
    expired secret is refused as expired, any other as unknown, from loopback too."""
    config = pb.FleetConfig(
        version=2,
        expired_keys=[
            pb.ExpiredKey(
                key_id="key_last",
                key_hash=digest("sk-iop-last"),
                expired_unix_ms=int(time.time() * 1000) - 1,
            )
        ],
    )
    ring = FleetHolder(fleet_from_proto(config))
    assert not ring.open
    loopback = Request(headers={"Authorization": "Bearer sk-iop-last"}, remote="127.0.0.1")
    with pytest.raises(KeyExpired):
        authenticate(loopback, ring)
    with pytest.raises(AuthenticationFailed):
        authenticate(Request(remote="127.0.0.1"), ring)
    # a control-plane from before keys_required: no key known at all, open again
    ring.replace(fleet_from_proto(pb.FleetConfig(version=3)))
    assert ring.open


def test_an_edge_whose_keys_were_all_revoked_or_forgotten_is_not_open() -> None:
    """The control-plane says keys were issued: with no key live, revoked or expired past
    the week it lists them, every request is refused, from loopback too, the old secret as
    unknown; only a fleet that never had a key is open."""
    ring = FleetHolder(fleet_from_proto(pb.FleetConfig(version=4, keys_required=True)))
    assert not ring.open
    for secret in ("sk-iop-revoked", "sk-iop-anything"):
        loopback = Request(headers={"Authorization": f"Bearer {secret}"}, remote="127.0.0.1")
        with pytest.raises(AuthenticationFailed) as refused:
            authenticate(loopback, ring)
        assert not isinstance(refused.value, KeyExpired)
        assert refused.value.message == "Incorrect API key provided."
    with pytest.raises(AuthenticationFailed):
        authenticate(Request(remote="127.0.0.1"), ring)
    ring.replace(fleet_from_proto(pb.FleetConfig(version=5, keys_required=False)))
    assert ring.open


def test_an_edge_with_no_fleet_config_yet_serves_nobody() -> None:
    """Before its first fleet config (no cached copy, the control-plane not answering) the
    edge cannot know whether keys are required: nothing is served, loopback included,
    rather than everything to loopback clients as the open API's operator."""
    ring = FleetHolder()
    assert not ring.configured
    assert not ring.open
    assert "no fleet config yet" in access_mode(ring, allow_open=False, host="127.0.0.1")
    check_open_access("10.0.0.2", ring, allow_open=False)  # not LoopbackOnly: not open
    for request in (Request(remote="127.0.0.1"), bearer("sk-iop-live")):
        with pytest.raises(ControlPlaneUnavailable) as refused:
            authenticate(request, ring)
        assert refused.value.status == 503
        assert "no fleet config yet" in refused.value.message
    ring.replace(fleet_from_proto(pb.FleetConfig(version=1)))  # a fleet that never had a key
    assert ring.configured
    assert ring.open
    assert authenticate(Request(remote="127.0.0.1"), ring) is None
