"""Whose fault a failed run is: the one reading of a run's error that failover
(docs/ARCHITECTURE.md#failover) and outlier ejection (#outlier-ejection) both act on.

A provider is tried elsewhere, and counted toward its ejection, only for what is its
own doing. What the request caused (a body the engine refuses, a prompt past the
model's context, a failure the client asked the mock for) would fail the same on every
provider of the model, and counting it would let one tenant take a model's providers
away from everyone; what the client or the edge ended says nothing about the provider.
"""

from __future__ import annotations

from enum import StrEnum

from iop_edge.domain.events import NOT_IMPLEMENTED, ErrorCode, Failed


class Fault(StrEnum):
    """Who caused a failed run."""

    PROVIDER = "provider"  # unreachable, too slow, a 5xx, a broken answer
    UNSUPPORTED = "unsupported"  # the provider does not offer the operation (a 501)
    REQUEST = "request"  # invalid, a 4xx, past the context, a drill it asked for
    CLIENT = "client"  # cancelled, or past the deadline the client set
    EDGE = "edge"  # a node queue full or timed out, a node's internal error


_REQUEST_CODES = frozenset(
    {ErrorCode.INVALID_REQUEST, ErrorCode.NOT_FOUND, ErrorCode.CONTEXT_LENGTH_EXCEEDED}
)
_CLIENT_CODES = frozenset({ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED})


def fault_of(failed: Failed, *, drill: bool = False) -> Fault:
    """Whose fault ``failed`` is; ``drill``: the request asked the mock provider to fail
    (``iop_mock``), so whatever the mock failed with is the request's own doing.

    The provider's: ``provider_unavailable`` (refused, reset, its node lost or silent),
    ``provider_timeout`` (past its operator's ``request_timeout_ms``, a stalled stream),
    ``provider_error`` with a 5xx or no HTTP status at all (a crash, a malformed answer).
    A ``provider_error`` with a 4xx is the request's, whatever the 4xx (Envoy counts
    5xx only, and a 401 or 429 from an upstream API says nothing about this provider's
    health that another request would not): as are ``invalid_request``, ``not_found``
    and ``context_length_exceeded``, but for an ``invalid_request`` with status 501,
    the provider's own limitation (llama.cpp without ``--embeddings``).
    """
    code = failed.code
    if code in _CLIENT_CODES:
        return Fault.CLIENT
    if drill:
        return Fault.REQUEST
    if code is ErrorCode.PROVIDER_UNAVAILABLE or code is ErrorCode.PROVIDER_TIMEOUT:
        return Fault.PROVIDER
    if code is ErrorCode.PROVIDER_ERROR:
        status = failed.provider_status
        return Fault.PROVIDER if status == 0 or status >= 500 else Fault.REQUEST
    if code in _REQUEST_CODES:
        if code is ErrorCode.INVALID_REQUEST and failed.provider_status == NOT_IMPLEMENTED:
            return Fault.UNSUPPORTED
        return Fault.REQUEST
    return Fault.EDGE  # queue_full, queue_timeout, internal


def retryable(failed: Failed) -> bool:
    """Would another provider of the model likely succeed where this one failed? The one
    rule of failover: yes for the provider's fault and for an operation it does not
    offer (the dispatcher stops choosing it for that operation; with nobody left, the
    400 stands), no for everything else (another provider would say the same, or nobody
    waits for the answer). A drill is retried as the failure it plays: failover is what
    it rehearses."""
    return fault_of(failed) in (Fault.PROVIDER, Fault.UNSUPPORTED)


def counts_against_provider(failed: Failed, *, drill: bool = False) -> bool:
    """Does ``failed`` count toward the provider's outlier ejection? Its own fault only."""
    return fault_of(failed, drill=drill) is Fault.PROVIDER
