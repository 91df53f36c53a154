"""The node's exception hierarchy. ``RunFailure`` subclasses become run errors with codes.

Each failure carries the protocol error code it becomes on the wire, so the
translation to ``run.event`` errors happens in exactly one place (the executor).
"""

from __future__ import annotations

from iop_proto.v1 import runtime_pb2 as pb


class NodeError(Exception):
    """Root of every error the node raises on purpose."""


class RunFailure(NodeError):
    """A run ended without a result; ``code`` is its ``run.event`` error code."""

    code: int = pb.ERROR_CODE_INTERNAL
    context_window: int = 0  # ContextLengthExceeded's, 0 for every other failure
    prompt_tokens: int = 0

    def __init__(self, message: str, *, provider_status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.provider_status = provider_status


class InvalidRequest(RunFailure, ValueError):
    """The run request cannot be executed as given (bad body, unknown provider, wrong target)."""

    code = pb.ERROR_CODE_INVALID_REQUEST


class ContextLengthExceeded(InvalidRequest):
    """The prompt (with the output asked) is past the model's context: the client must
    shorten it, and another provider of the model would say the same. The numbers are
    the provider's (0 when it did not say them)."""

    code = pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED

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
    code = pb.ERROR_CODE_NOT_FOUND


class QueueFull(RunFailure):
    code = pb.ERROR_CODE_QUEUE_FULL


class QueueTimeout(RunFailure, TimeoutError):
    code = pb.ERROR_CODE_QUEUE_TIMEOUT


class ProviderUnavailable(RunFailure, ConnectionError):
    """The provider could not be reached (connection refused, DNS, reset before a reply)."""

    code = pb.ERROR_CODE_PROVIDER_UNAVAILABLE


class ProviderFailed(RunFailure):
    """The provider answered with an error (HTTP status, non-zero exit, error object)."""

    code = pb.ERROR_CODE_PROVIDER_ERROR


class ProviderTimeout(RunFailure, TimeoutError):
    """The run passed its deadline (request_timeout_ms or the edge's deadline)."""

    code = pb.ERROR_CODE_PROVIDER_TIMEOUT


class RunCancelled(RunFailure):
    """The edge cancelled the run (client gone) or its connection dropped."""

    code = pb.ERROR_CODE_CANCELLED


class ConfigError(NodeError, ValueError):
    """A provider config from the edge cannot be applied (unknown type, bad settings)."""
