"""A request's routing hints, read in one place (``entrypoints.routing_hints``): the run's
session, queue share, pin and drill; the operators' headers refused from tenants."""

from __future__ import annotations

import pytest

from iop_edge.domain.fleet import ApiKeyEntry
from iop_edge.domain.queue import Share
from iop_edge.entrypoints.routing_hints import routing_hints
from iop_edge.errors import InvalidRequest, OperatorOnly, PriorityNotAllowed

OPS = ApiKeyEntry("key_op", "ops", "hash-op", frozenset(), 0, operator=True, priority=1)
ALICE = ApiKeyEntry("key_a", "alice", "hash-a", frozenset(), 0, weight=3, priority=2)


def test_a_request_that_asks_nothing_sets_nothing() -> None:
    assert routing_hints(None, {}, {"model": "m"}, {"model": "m"}) == {}


def test_a_key_gives_its_share_and_scopes_the_session() -> None:
    hints = routing_hints(ALICE, {"x-session-id": "s1"}, {}, {})
    assert hints == {
        "session": "key_a\x00s1",
        "scope": "key_a",
        "share": Share(key="key_a", weight=3, priority=2),
    }
    assert routing_hints(ALICE, {}, {}, {}) == {
        "session": None,
        "scope": "key_a",
        "share": Share(key="key_a", weight=3, priority=2),
    }


def test_the_priority_header_is_an_operator_s() -> None:
    header = {"x-iop-priority": " -5 "}
    assert routing_hints(OPS, header, {}, {})["share"] == Share("key_op", 1, -5)
    assert routing_hints(None, header, {}, {}) == {"share": Share(priority=-5)}  # open API
    with pytest.raises(PriorityNotAllowed):
        routing_hints(ALICE, header, {}, {})
    for bad in ("high", "", str(2**31), str(-(2**31) - 1)):
        with pytest.raises(InvalidRequest):
            routing_hints(OPS, {"x-iop-priority": bad}, {}, {})


def test_a_drill_is_read_from_the_runs_body_and_allowed_to_operators() -> None:
    drill = {"iop_mock": {"fail": "provider_error"}}
    assert routing_hints(OPS, {}, {}, drill)["drill"] is True
    assert "drill" not in routing_hints(OPS, {}, drill, {})  # the client's body: not the run's
    with pytest.raises(InvalidRequest):
        routing_hints(ALICE, {}, {}, drill)
    assert routing_hints(ALICE, {}, {}, drill, mock_drills=True)["drill"] is True
    assert "drill" not in routing_hints(ALICE, {}, {}, {"iop_mock": {"fill": True}})


def test_a_tenant_s_pin_is_refused_before_its_drill() -> None:
    with pytest.raises(OperatorOnly):
        routing_hints(ALICE, {"x-iop-provider": "p"}, {}, {"iop_mock": {"fail": "x"}})
