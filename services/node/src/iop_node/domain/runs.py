"""What a run is inside the node: the order from the edge, the spec an adapter executes
and the events it emits.

Domain dataclasses, converted from and to protobuf at the rim (``entrypoints/wire.py``),
so nothing inside sees the wire format. The request body stays the bytes the edge sent
(``ExecutionSpec.body_json``): an order the edge prepared for its provider's type
(``body_prepared``) is posted as it came, and it is parsed only by an adapter that reads
it as a dict (``ExecutionSpec.body``), at most once.
"""

from __future__ import annotations

from dataclasses import field
from enum import StrEnum
from typing import Any

from iop_node.domain.record import record
from iop_node.errors import InvalidRequest
from iop_proto import json_codec


class Operation(StrEnum):
    CHAT_COMPLETIONS = "chat_completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    COUNT_TOKENS = "count_tokens"
    """A chat body's prompt tokens under the model's template and tokenizer, nothing
    generated: run outside the capacity gate (``executor``)."""


@record
class RunOrder:
    """A run as the edge ordered it (``pb.RunRequest`` at the rim), not yet checked
    against the provider it names (``service.run_check``)."""

    run_id: str
    model: str  # the public model id
    provider_id: str
    adapter: str  # the provider's type, as the edge knows it
    target: str  # the provider's served name
    operation: Operation | None  # None: an operation this node does not know
    body_json: bytes
    stream: bool
    include_usage: bool
    deadline_unix_ms: int  # 0: the provider's own request timeout
    body_prepared: bool = False
    """``body_json`` is what an OpenAI-compatible provider gets, byte for byte (the edge
    applied the type's field allow-list, the served model and the streaming switches);
    an older edge sends the client's body (model written) and the node prepares it."""
    prompt_blocks: tuple[int, ...] | None = None
    """The prompt's block hashes (``iop_proto.prefix``), hashed once by the edge (with a
    prepared body); ``None``: the node hashes the body when it needs them."""
    traceparent: str = ""
    """The edge's span of the request (W3C traceparent); "": not traced, no node span."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a dict (an empty body is an empty object)."""
    try:
        body = json_codec.loads(raw) if raw else {}
    except ValueError as exc:
        raise InvalidRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


@record
class ExecutionSpec:
    """Everything an adapter needs to run one request on its provider.

    ``target`` is the served model name the edge chose and wrote into the body (the
    node never rewrites model names). ``body_json`` is the body as it came;
    ``body`` is it parsed, on first use, once. ``deadline`` is on the event loop's
    clock (``loop.time()``) and bounds the whole run, queue wait included.
    """

    run_id: str
    model: str
    provider_id: str
    adapter: str
    target: str
    operation: Operation
    body_json: bytes
    stream: bool
    include_usage: bool
    deadline: float
    body_prepared: bool = False  # see ``RunOrder.body_prepared``
    prompt_blocks: tuple[int, ...] | None = None
    """The prompt's block hashes from the edge; ``None``: hash ``body`` when needed."""
    traceparent: str = ""  # see ``RunOrder.traceparent``
    parsed: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """``body`` once parsed (``run_check`` parses an unprepared body up front)."""

    @property
    def body(self) -> dict[str, Any]:
        """The body as a dict, parsed on first use; ``InvalidRequest`` if it is not one."""
        parsed = self.parsed
        if parsed is None:
            parsed = parse_body(self.body_json)
            object.__setattr__(self, "parsed", parsed)  # a cache, not a change of value
        return parsed


@record
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those the engine took from its prompt cache (0: none, or an
    engine that does not say)."""
    prefill_ms_per_token: float | None = None
    """The engine's own prefill time per evaluated prompt token (llama.cpp's timings),
    for the node's cache account; not sent to the edge."""

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt, completion, prompt + completion)


@record
class ToolCallDelta:
    index: int
    id: str = ""
    type: str = ""
    function_name: str = ""
    function_arguments: str = ""


@record
class Delta:
    """A piece of a streamed answer (one SSE chunk's worth)."""

    text: str = ""
    role: str = ""
    choice_index: int = 0
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str = ""
    reasoning_text: str = ""
    usage: Usage | None = None
    logprobs_json: bytes = b""  # the choice's ``logprobs`` as JSON, when the provider sent them
    provider_us: int = 0  # a run's first delta: the wait on the provider up to it (executor)


@record
class Completion:
    """How a run ended well: returned by ``Adapter.execute``.

    For a non-streaming run ``result`` is the OpenAI-shaped response body
    (``chat.completion``, ``text_completion`` or the embeddings ``list``) with the
    provider's fields kept; for a streaming run it is ``None`` (the deltas were
    the answer). ``result_json``, when not empty, is ``result`` exactly as the
    provider encoded it: it is forwarded as is instead of encoding ``result``
    again, so nothing may change ``result`` once it is set.

    ``provider_us`` is the run's time waiting on the provider, in microseconds: an
    adapter that can tell its own work from the provider's sets it; otherwise the
    executor puts the whole ``execute`` call's time there. The edge subtracts it
    from its own time for ``x-iop-overhead-ms``.
    """

    finish_reason: str = ""
    usage: Usage | None = None
    result: dict[str, Any] | None = None
    result_json: bytes = b""
    provider_us: int = 0
