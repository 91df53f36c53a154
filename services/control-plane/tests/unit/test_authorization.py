"""The registration rule, case by case (pure: no store, no network)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from iop_control_plane.domain.authorization import Refusal, authorize
from iop_control_plane.domain.credentials import NodeToken, new_node_token
from iop_control_plane.domain.fleet import FleetSpec, parse_fleet

NOW = datetime(2026, 11, 29, tzinfo=UTC)


@pytest.fixture
def fleet() -> FleetSpec:
    data = {
        "models": [{"id": "m", "providers": {"a-mock": "m"}}],
        "nodes": [
            {
                "id": "node-a",
                "providers": [{"id": "a-mock", "type": "mock", "category": "api", "models": ["m"]}],
            },
            {"id": "node-b"},
        ],
    }
    return parse_fleet(data, "test").spec


@pytest.fixture
def token() -> NodeToken:
    return new_node_token("node-a", NOW).token


def test_right_token_right_certificate_is_accepted(fleet: FleetSpec, token: NodeToken) -> None:
    decision = authorize("node-a", "node-a", token, fleet)
    assert decision.accepted
    assert decision.token_id == token.token_id
    assert decision.node is not None
    assert [p.id for p in decision.node.providers] == ["a-mock"]


@pytest.mark.parametrize(
    ("node_id", "identity", "use_token", "refusal", "reason"),
    [
        ("", "node-a", True, Refusal.MALFORMED, "required"),
        ("node-a", "node-b", True, Refusal.IDENTITY_MISMATCH, "'node-b' does not match"),
        ("node-a", "node-a", False, Refusal.UNKNOWN_TOKEN, "not known"),
        ("node-b", "node-b", True, Refusal.OTHER_NODE, "issued for node 'node-a', not 'node-b'"),
    ],
)
def test_refusals_name_their_reason(
    fleet: FleetSpec,
    token: NodeToken,
    node_id: str,
    identity: str,
    use_token: bool,
    refusal: Refusal,
    reason: str,
) -> None:
    decision = authorize(node_id, identity, token if use_token else None, fleet)
    assert not decision.accepted
    assert decision.refusal is refusal
    assert reason in decision.reason
    assert decision.node is None


def test_revoked_token_is_refused(fleet: FleetSpec, token: NodeToken) -> None:
    decision = authorize("node-a", "node-a", token.revoke(NOW), fleet)
    assert decision.refusal is Refusal.REVOKED
    assert token.token_id in decision.reason


def test_node_missing_from_the_fleet_is_refused(fleet: FleetSpec) -> None:
    stray = new_node_token("node-z", NOW).token
    decision = authorize("node-z", "node-z", stray, fleet)
    assert decision.refusal is Refusal.UNKNOWN_NODE


def test_identity_is_checked_before_the_token(fleet: FleetSpec) -> None:
    """A caller without the node's certificate learns nothing about a token's validity."""
    decision = authorize("node-a", "intruder", None, fleet)
    assert decision.refusal is Refusal.IDENTITY_MISMATCH


@pytest.mark.parametrize("state", ["revoked", "live", "none"])
def test_a_retired_node_is_refused_as_retired_whatever_its_token(
    fleet: FleetSpec, token: NodeToken, state: str
) -> None:
    """`node retire` revokes the node's tokens too: the refusal says why it really is
    out, and what admits it again, not that its token was revoked."""
    presented = {"revoked": token.revoke(NOW), "live": token, "none": None}[state]
    decision = authorize("node-a", "node-a", presented, fleet, retired={"node-a"})
    assert decision.refusal is Refusal.RETIRED
    assert "node 'node-a' is retired" in decision.reason
    assert "iop-control-plane node add node-a" in decision.reason
    assert "revoked" not in decision.reason.replace("node retire", "")
