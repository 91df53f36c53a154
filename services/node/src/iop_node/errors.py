"""The node's exception hierarchy. ``RunFailure`` subclasses become run errors with codes.

Each failure carries its ``ErrorCode``, a domain value named as history, metrics and the
edge's errors name it (``queue_full``); the wire's numbers for them live in one place,
the rim's conversion module (``entrypoints/wire.py``).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """How a run failed, as the node's history and metrics record it."""

    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_TIMEOUT = "provider_timeout"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class NodeError(Exception):
    """Root of every error the node raises on purpose."""


class RunFailure(NodeError):
    """A run ended without a result; ``code`` is its ``run.event`` error code."""

    code: ErrorCode = ErrorCode.INTERNAL
    context_window: int = 0  # ContextLengthExceeded's, 0 for every other failure
    prompt_tokens: int = 0

    def __init__(self, message: str, *, provider_status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.provider_status = provider_status


class InvalidRequest(RunFailure, ValueError):
    """The run request cannot be executed as given (bad body, unknown provider, wrong target)."""

    code = ErrorCode.INVALID_REQUEST


class ContextLengthExceeded(InvalidRequest):
    """The prompt (with the output asked) is past the model's context: the client must
    shorten it, and another provider of the model would say the same. The numbers are
    the provider's (0 when it did not say them)."""

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED

    def __init__(
        self,
        message: str,
        *,
        provider_status: int = 0,
        context_window: int = 0,
        prompt_tokens: int = 0,
    ) -> None:
        super().__init__(message, provider_status=provider_status)
        self.context_window = context_window
        self.prompt_tokens = prompt_tokens


class AnswerTooLarge(InvalidRequest):
    """The engine's answer is larger than one frame can carry to the edge.

    The request asked for it (log probabilities of many tokens, a long output from a
    model with a large output cap): another provider would answer as much, so it is the
    request's failure (``INVALID_REQUEST``: no failover, never counted against the
    provider), and that run's alone: the answer is refused after at most ``limit``
    bytes read, never parsed or framed whole, and the node's link carries on."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The answer is too large: the provider's answer passed {limit} bytes, this "
            "server's limit for one answer (or one streamed event). Ask for fewer output "
            "tokens or fewer log probabilities."
        )
        self.limit = limit


class UnknownProvider(InvalidRequest):
    code = ErrorCode.NOT_FOUND


class QueueFull(RunFailure):
    code = ErrorCode.QUEUE_FULL


class ProviderHeld(QueueFull):
    """An operator disabled or drains the provider (docs/ARCHITECTURE.md#runtime-control):
    a run not started yet is handed back before its first byte, with a code the edge
    fails over on; the provider is not marked unavailable for it (it is fine)."""

    code = ErrorCode.PROVIDER_UNAVAILABLE


class QueueTimeout(RunFailure, TimeoutError):
    code = ErrorCode.QUEUE_TIMEOUT


class ProviderUnavailable(RunFailure, ConnectionError):
    """The provider could not be reached (connection refused, DNS, reset before a reply)."""

    code = ErrorCode.PROVIDER_UNAVAILABLE


class ProviderFailed(RunFailure):
    """The provider answered with an error (HTTP status, non-zero exit, error object)."""

    code = ErrorCode.PROVIDER_ERROR


class ProviderTimeout(RunFailure, TimeoutError):
    """The run passed its deadline (request_timeout_ms or the edge's deadline)."""

    code = ErrorCode.PROVIDER_TIMEOUT


class RunCancelled(RunFailure):
    """The edge cancelled the run (client gone) or its connection dropped."""

    code = ErrorCode.CANCELLED


class ConfigError(NodeError, ValueError):
    """A provider config from the edge cannot be applied (unknown type, bad settings)."""
