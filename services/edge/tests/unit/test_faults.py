"""Whose fault a failed run is (domain/faults.py): the one reading failover and outlier
ejection act on, and the mock drills' gate (domain/drills.py)."""

from __future__ import annotations

import pytest

from iop_edge.domain.drills import asks_drill, may_drill
from iop_edge.domain.events import ErrorCode, Failed
from iop_edge.domain.faults import Fault, counts_against_provider, fault_of, retryable
from iop_edge.domain.fleet import ApiKeyEntry

CASES = [
    # the provider's
    (Failed(ErrorCode.PROVIDER_UNAVAILABLE, "connection refused"), Fault.PROVIDER),
    (Failed(ErrorCode.PROVIDER_UNAVAILABLE, "connection reset before a reply"), Fault.PROVIDER),
    (Failed(ErrorCode.PROVIDER_TIMEOUT, "no answer in request_timeout_ms"), Fault.PROVIDER),
    (Failed(ErrorCode.PROVIDER_ERROR, "HTTP 500", provider_status=500), Fault.PROVIDER),
    (Failed(ErrorCode.PROVIDER_ERROR, "HTTP 503", provider_status=503), Fault.PROVIDER),
    (Failed(ErrorCode.PROVIDER_ERROR, "engine crashed mid-answer"), Fault.PROVIDER),  # no status
    (Failed(ErrorCode.PROVIDER_ERROR, "response is not JSON"), Fault.PROVIDER),
    # the request's: an engine refusing a parameter, a body past the context
    (Failed(ErrorCode.INVALID_REQUEST, "HTTP 400: failed to parse grammar", 400), Fault.REQUEST),
    (Failed(ErrorCode.INVALID_REQUEST, "iop_mock.fail must be one of"), Fault.REQUEST),
    (Failed(ErrorCode.PROVIDER_ERROR, "ollama 400", provider_status=400), Fault.REQUEST),
    (Failed(ErrorCode.PROVIDER_ERROR, "HTTP 413", provider_status=413), Fault.REQUEST),
    (Failed(ErrorCode.PROVIDER_ERROR, "HTTP 429", provider_status=429), Fault.REQUEST),
    (Failed(ErrorCode.NOT_FOUND, "no such model"), Fault.REQUEST),
    (Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", 400, 0, 256, 431), Fault.REQUEST),
    # not the provider's, not the request's
    (Failed(ErrorCode.INVALID_REQUEST, "no --embeddings", 501), Fault.UNSUPPORTED),
    (Failed(ErrorCode.CANCELLED, "client gone"), Fault.CLIENT),
    (Failed(ErrorCode.DEADLINE_EXCEEDED, "the client's deadline"), Fault.CLIENT),
    (Failed(ErrorCode.QUEUE_FULL, "node queue"), Fault.EDGE),
    (Failed(ErrorCode.QUEUE_TIMEOUT, "node queue"), Fault.EDGE),
    (Failed(ErrorCode.INTERNAL, "node bug"), Fault.EDGE),
]


@pytest.mark.parametrize(("failed", "fault"), CASES)
def test_whose_fault_a_failure_is(failed: Failed, fault: Fault) -> None:
    assert fault_of(failed) is fault
    assert counts_against_provider(failed) is (fault is Fault.PROVIDER)
    assert retryable(failed) is (fault in (Fault.PROVIDER, Fault.UNSUPPORTED))


@pytest.mark.parametrize(("failed", "fault"), CASES)
def test_a_drill_s_failure_is_the_request_s_and_never_counts(failed: Failed, fault: Fault) -> None:
    """The mock failing as asked (a 500, unavailable, a hang to the deadline) is what the
    request did: never counted toward ejection. Failover still retries it: that is what
    such a drill rehearses."""
    drilled = fault_of(failed, drill=True)
    assert drilled is (Fault.CLIENT if fault is Fault.CLIENT else Fault.REQUEST)
    assert not counts_against_provider(failed, drill=True)


def key(operator: bool) -> ApiKeyEntry:
    return ApiKeyEntry("key_1", "k", "hash", frozenset(), 0, operator=operator)


@pytest.mark.parametrize(
    ("body", "asks"),
    [
        ({"iop_mock": {"fail": "provider_error"}}, True),
        ({"iop_mock": {"fail": "timeout", "after_tokens": 2}}, True),
        ({"iop_mock": {"status": 500}}, True),
        ({"iop_mock": {"delay_ms": 30_000}}, True),  # a slot held as long as asked
        ({"iop_mock": {"fill": True}}, False),  # the answer's length only: open to all
        ({"iop_mock": {}}, False),
        ({"iop_mock": "fail"}, False),  # no object: the mock refuses it as invalid
        ({"model": "m", "fail": "provider_error"}, False),
    ],
)
def test_what_asks_for_a_drill(body: dict[str, object], asks: bool) -> None:
    assert asks_drill(body) is asks


def test_who_may_ask_for_a_drill() -> None:
    assert may_drill(key(operator=True), open_to_all=False)
    assert not may_drill(key(operator=False), open_to_all=False)
    assert not may_drill(None, open_to_all=False)  # an open API is no operator either
    assert may_drill(key(operator=False), open_to_all=True)
    assert may_drill(None, open_to_all=True)
