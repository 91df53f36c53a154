"""The edge's exception hierarchy; each expected failure knows its OpenAI error shape.

Errors become HTTP statuses and OpenAI error objects in exactly one place
(``entrypoints/openai_errors.py``); raising code only picks the right class.
"""

from __future__ import annotations

from iop_edge.domain.events import NOT_IMPLEMENTED, ErrorCode, Failed


class EdgeError(Exception):
    """Root of every error the edge raises on purpose (and an OpenAI error when it escapes)."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    retry_after_s: int | None = None  # sent as ``Retry-After``: the client may retry then

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(EdgeError, ValueError):
    status, type = 400, "invalid_request_error"


class UnsupportedOperation(InvalidRequest):
    """No provider of the model offers the operation (the fleet file's ``operations``, or
    every one answered 501): a 400 naming both, which SDKs do not retry."""

    code = "unsupported_operation"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (with the output asked) is past the model's context, as its provider
    said: OpenAI's ``context_length_exceeded`` (agents compact the conversation on it)
    and, on the Messages API, Anthropic's "prompt is too long" (``anthropic_message``).
    The numbers are the provider's; 0 when it did not say them."""

    code = "context_length_exceeded"

    def __init__(self, said: str, *, context_window: int = 0, prompt_tokens: int = 0) -> None:
        window, prompt = context_window, prompt_tokens
        if window and prompt > window:
            message = (
                f"This model's maximum context length is {window} tokens. However, your "
                f"messages resulted in {prompt} tokens. Please reduce the length of the messages."
            )
            self.anthropic_message = f"prompt is too long: {prompt} tokens > {window} maximum"
        elif window and prompt:  # the prompt fits, not with the output asked
            message = (
                f"This model's maximum context length is {window} tokens. However, your "
                f"messages resulted in {prompt} tokens, which with the output asked do not "
                "fit. Please reduce the length of the messages or of the output."
            )
            self.anthropic_message = (
                f"input length and `max_tokens` exceed context limit: {prompt} + max_tokens "
                f"> {window}, decrease input length or `max_tokens` and try again"
            )
        else:
            limit = f" is {window} tokens" if window else " was exceeded"
            message = (
                f"This model's maximum context length{limit}. However, your messages do not "
                f"fit ({said}). Please reduce the length of the messages."
            )
            self.anthropic_message = f"prompt is too long: {said}"
        super().__init__(message, param="messages")
        self.context_window = window
        self.prompt_tokens = prompt


class RequestTooLarge(EdgeError, ValueError):
    """The body is over the HTTP limit, or its run would not fit in one frame to the node."""

    status, type, code = 413, "invalid_request_error", "request_too_large"


class NotFound(EdgeError, LookupError):
    """An unknown file or batch id (OpenAI: ``No such File object: <id>``, code null)."""

    status, type, code = 404, "invalid_request_error", None


class StorageQuotaExceeded(EdgeError):
    """The key's stored responses or files are at its quota (``storage`` settings): the
    request is refused before it runs; deleting stored objects, or ``store: false``,
    makes room. Not a 429: nothing frees up by waiting, so a client must not retry."""

    status, type, code = 400, "invalid_request_error", "storage_quota_exceeded"


class StorageUnavailable(EdgeError):
    """What the answer would say is stored could not be committed, or the shared store
    (PostgreSQL) cannot be reached now: the client is told so, and may retry."""

    status, type, code = 503, "server_error", "storage_unavailable"
    retry_after_s = 2


class LeaseLost(EdgeError):
    """A worker's batch lease is no longer its own (expired and taken, released, or the
    batch is being cancelled or has ended): the worker stops working on that batch."""

    status, type, code = 409, "invalid_request_error", "lease_lost"


class AuthenticationFailed(EdgeError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class KeyExpired(AuthenticationFailed):
    """The request's key (or a rotation's previous secret of it) is past its expiry: the
    code stays ``invalid_api_key`` (as a revoked key's), the message says why."""


class KeyRevoked(AuthenticationFailed):
    """The request's key was revoked while it ran or waited: the request is ended."""


class LoopbackOnly(AuthenticationFailed):
    """No API keys exist and ``http.allow_open`` is off: only loopback clients are served."""


class ModelNotAllowed(EdgeError):
    status, type, code = 403, "invalid_request_error", "model_not_allowed"


class PriorityNotAllowed(EdgeError):
    """A key that is not an operator's sent ``x-iop-priority`` (entrypoints/routing_hints.py)."""

    status, type, code = 403, "invalid_request_error", "priority_not_allowed"


class OperatorOnly(EdgeError):
    """A key that is not an operator's asked for what only operators see (the fleet's
    history, entrypoints/history_routes.py)."""

    status, type, code = 403, "invalid_request_error", "operator_only"


class ModelNotFound(EdgeError, LookupError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class QueueFull(EdgeError):
    """429 with ``Retry-After``: the model's queue (or the key's concurrency) is full."""

    status, type, code = 429, "rate_limit_error", "queue_full"
    retry_after_s = 1


class TooManyConcurrent(QueueFull):
    code = "concurrency_limit_exceeded"


class RateLimited(EdgeError):
    """A key's requests or tokens per minute are used up (docs/ARCHITECTURE.md#limits-per-key):
    OpenAI's ``rate_limit_exceeded`` whose ``type`` says which (``requests`` or ``tokens``);
    on the Messages API a ``rate_limit_error``. ``Retry-After`` says when it would pass."""

    status, type, code = 429, "requests", "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.type = kind
        self.retry_after_s = retry_after_s


class QuotaExceeded(EdgeError):
    """A key's token budget for its period is used up: OpenAI's ``insufficient_quota``
    (429; retrying will not help before the period ends, which ``Retry-After`` says)."""

    status, type, code = 429, "insufficient_quota", "insufficient_quota"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoProviderAvailable(EdgeError):
    status, type, code = 503, "server_error", "no_provider_available"


class ShuttingDown(NoProviderAvailable):
    """The edge is stopping: nothing new is taken (a batch line stays pending, as for any
    other fleet without room), and what waits for a slot when the drain begins gets this,
    with ``Retry-After``: another edge, or this one restarted, will take it."""

    code = "shutting_down"
    retry_after_s = 1


class TooManyConnections(EdgeError):
    """The API holds its most client connections (``http.max_connections``): a new one is
    answered this, canned, before any of it is parsed (``iop_proto.service.http_site``)."""

    status, type, code = 503, "server_error", "too_many_connections"


class QueueTimeout(EdgeError, TimeoutError):
    status, type, code = 503, "server_error", "queue_timeout"


class Preempted(EdgeError):
    """A batch line's run was ended to give its slot to an interactive request
    (``service/backfill.py``): its line goes back in the queue, never to a client."""

    status, type, code = 503, "server_error", "preempted"


class ProviderFailed(EdgeError):
    """The provider answered with an error (or could not run the request)."""

    status, type, code = 502, "server_error", "provider_error"


class ProviderTimeout(EdgeError, TimeoutError):
    status, type, code = 504, "server_error", "provider_timeout"


class ControlPlaneUnavailable(EdgeError, ConnectionError):
    """Registrations fail closed while the control-plane is away, and an edge with no
    fleet config yet (none cached) serves no request: it cannot tell whether keys are
    required."""

    status, type, code = 503, "server_error", "control_plane_unavailable"


NOT_FOUND = 404
"""A provider's answer when it does not serve the model named (vLLM: "The model `x` does
not exist."): the fleet names a served name the provider lacks."""


def from_failure(failure: Failed) -> EdgeError:
    """The one mapping from a run's error code to what the client sees."""
    message = failure.message or failure.code.value
    match failure.code:
        case ErrorCode.INVALID_REQUEST if failure.provider_status == NOT_IMPLEMENTED:
            return UnsupportedOperation(message)
        case ErrorCode.INVALID_REQUEST if failure.provider_status == NOT_FOUND:
            return ModelNotFound(message, param="model")
        case ErrorCode.INVALID_REQUEST:
            return InvalidRequest(message)
        case ErrorCode.CONTEXT_LENGTH_EXCEEDED:
            return ContextLengthExceeded(
                message, context_window=failure.context_window, prompt_tokens=failure.prompt_tokens
            )
        case ErrorCode.NOT_FOUND:
            return ModelNotFound(message)
        case ErrorCode.QUEUE_FULL:
            return QueueFull(message)
        case ErrorCode.QUEUE_TIMEOUT:
            return QueueTimeout(message)
        case ErrorCode.PROVIDER_UNAVAILABLE:
            return NoProviderAvailable(message, code="provider_unavailable")
        case ErrorCode.PROVIDER_TIMEOUT | ErrorCode.DEADLINE_EXCEEDED:
            return ProviderTimeout(message)
        case ErrorCode.PROVIDER_ERROR:
            return ProviderFailed(message)
        case ErrorCode.CANCELLED:
            return ProviderFailed(message, code="cancelled")
    return EdgeError(message, code="internal_error")
