"""What a run tells the edge, as plain values: ``Started | Delta | Completed | Failed``.

The node's protobuf events are converted once, where they arrive
(``adapters/run_wire.py``); everything past the node listener (the run, the
HTTP relay, batch lines, the run trace) sees only these, and ``Retrying``, which the
edge itself puts between two attempts of one run (``service/request_run.py``). Slotted and frozen:
one small object per event, on the path every token takes, and nothing to copy
(a delta's text is the string the wire gave).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.fleet import Operation
from iop_edge.domain.warmth import LoadReport


class ErrorCode(StrEnum):
    """Why a run failed, in the edge's words (the wire's codes map onto these)."""

    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_TIMEOUT = "provider_timeout"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt is past the context


NOT_IMPLEMENTED = 501
"""A provider's answer when it does not offer the operation (the node passes it on)."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those the engine served from its prompt cache (0: none, or
    an engine that does not say). Each API shows it in its own words (``formats``)."""


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of one tool call; ``id``, ``type`` and the name come once, in its first."""

    index: int = 0
    id: str = ""
    type: str = ""
    function_name: str = ""
    function_arguments: str = ""


@dataclass(frozen=True, slots=True)
class Started:
    """The node began the run on ``provider_id`` after ``queue_wait_ms`` in its queue."""

    provider_id: str = ""
    target: str = ""
    queue_wait_ms: int = 0


@dataclass(slots=True)
class Delta:
    """A piece of one choice's output (a token, a reasoning fragment, tool-call parts).

    Slotted but not frozen, unlike the other events: it is made once per token by the
    wire adapter and nothing changes it afterwards, which the readers' tests hold; a
    frozen one's ``object.__setattr__`` per field would guard nothing more.
    """

    text: str = ""
    choice_index: int = 0
    role: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str = ""
    usage: Usage | None = None
    reasoning_text: str = ""
    logprobs_json: bytes = b""  # the provider's choice ``logprobs``, JSON as it sent it
    provider_us: int = 0  # a run's first delta: the node's wait on the provider up to it


@dataclass(frozen=True, slots=True)
class Completed:
    """The run's end: why, its usage, and the provider's whole result when it sent one.

    ``start``: the run's start when it came with the end (a node that finished the run
    within its acknowledgement hold sends one event for all three: ``run_reader``
    gives the start to the sink first); ``None`` when it came on its own before.
    """

    finish_reason: str = ""
    usage: Usage | None = None
    result_json: bytes = b""
    provider_us: int = 0  # the node's wait on the provider over the run (x-iop-overhead-ms)
    start: Started | None = None
    load: ProviderLoad | None = field(default=None, compare=False, repr=False)
    """The run's provider as the run ended, from a node that sends it (``ProviderLoad``):
    about the provider, not the run, so no part of the outcome's value."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The run's end in an error (from the node, or the edge's own: cancel, deadline)."""

    code: ErrorCode
    message: str = ""
    provider_status: int = 0
    provider_us: int = 0  # the node's wait on the provider before it failed
    context_window: int = 0  # with CONTEXT_LENGTH_EXCEEDED: the provider's numbers (0: unsaid)
    prompt_tokens: int = 0
    load: ProviderLoad | None = field(default=None, compare=False, repr=False)
    """As ``Completed.load``: the provider's, never the run's."""


@dataclass(frozen=True, slots=True)
class Retrying:
    """The run failed with ``failed`` on ``provider_id`` before the client got anything,
    and starts again on another provider (docs/ARCHITECTURE.md#failover): a reader drops
    what it kept of the run so far (the deltas of a non-streamed answer)."""

    failed: Failed
    provider_id: str = ""


@dataclass(frozen=True, slots=True)
class Accepted:
    """The node took the run (before its own queue): the run's acknowledgement. Not a
    ``RunEvent``: it ends the run's ack guard and is never queued for a reader."""


ACCEPTED = Accepted()
"""The one instance (it carries nothing): the wire adapter allocates none per run."""

RunEvent = Started | Delta | Completed | Failed | Retrying
TERMINAL = (Completed, Failed)
"""The events that end a run (``isinstance(event, TERMINAL)``)."""


@dataclass(frozen=True, slots=True)
class RunOrder:
    """A run as the dispatcher sends it to a node: the target already chosen and the
    body already rewritten to the provider's served name."""

    run_id: str
    model: str  # the public model id
    provider_id: str
    adapter: str  # the provider's type
    target: str  # the provider's served name
    operation: Operation
    body_json: bytes
    stream: bool
    deadline_unix_ms: int
    include_usage: bool
    # The request asked the mock provider to fail (``iop_mock``, domain/drills.py): what
    # the run ends with is never counted against the provider. The node is not told.
    drill: bool = False
    # ``body_json`` is what the provider's type gets, byte for byte (``RunBody``), and the
    # prompt's block hashes come with it (``iop_proto.prefix``; empty when not prompted).
    body_prepared: bool = False
    prompt_blocks: tuple[int, ...] = ()
    traceparent: str = ""  # the request's span (RunSpec.traceparent); "" untraced


@dataclass(frozen=True, slots=True)
class ProviderLoad:
    """A run's provider as its node saw it once the run let go of its slot (the node's
    ``ProviderLoad``, on the run's end): the part of a snapshot a run changes."""

    in_flight: int
    queued: int
    cache: CacheReport | None = None


@dataclass(frozen=True, slots=True)
class ProviderReport:
    """One provider's state in a node's snapshot, as the registry takes it."""

    provider_id: str
    health: str  # ``pool.AVAILABLE``, ``UNAVAILABLE`` or ``UNKNOWN``
    in_flight: int = 0
    queued: int = 0
    models: tuple[str, ...] = ()
    detail: str = ""
    lifecycle: dict[str, bool] | None = None
    cache: CacheReport | None = None
    """What its engine's prompt cache holds; ``None`` from a node that does not say."""
    engine: dict[str, str | int] | None = None
    """Its engine's name, version and device (``QualificationEngine``); ``None``: not said."""
    loaded: LoadReport | None = None
    """What it holds in memory; ``None``: every model, always (or a node that does not say)."""
