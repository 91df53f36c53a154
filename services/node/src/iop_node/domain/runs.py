"""What a run is inside the node: the spec an adapter executes and the events it emits.

Domain dataclasses, converted from and to protobuf at the edge link, so adapters
never see the wire format. The request body is parsed once (at the link) into
``ExecutionSpec.body``; adapters forward what they do not interpret unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from iop_node.domain.record import record


class Operation(StrEnum):
    CHAT_COMPLETIONS = "chat_completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    COUNT_TOKENS = "count_tokens"
    """A chat body's prompt tokens under the model's template and tokenizer, nothing
    generated: run outside the capacity gate (``executor``)."""


@record
class ExecutionSpec:
    """Everything an adapter needs to run one request on its provider.

    ``target`` is the served model name the edge chose (the node never rewrites
    model names); ``body`` is the client's OpenAI request with ``model`` already
    set to ``target``. ``deadline`` is on the event loop's clock
    (``loop.time()``) and bounds the whole run, queue wait included.
    """

    run_id: str
    model: str
    provider_id: str
    adapter: str
    target: str
    operation: Operation
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    deadline: float


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


@dataclass(slots=True)
class RunTimings:
    """Event-loop timestamps of a run's life, for history and metrics."""

    received: float
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
