"""The node's ports: what the core needs from adapters, the event sink and the history store.

Small, all-async protocols. An adapter knows one provider type and nothing of
capacity, queues, the edge or history: the executor wraps every adapter the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import aiohttp

from iop_node.domain.events import Failed, Started
from iop_node.domain.health import ProbeResult
from iop_node.domain.model_load import LoadState
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.record import record
from iop_node.domain.runs import Completion, Delta, ExecutionSpec
from iop_proto.framing import DEFAULT_MAX_ANSWER_BYTES

if TYPE_CHECKING:  # the client is an adapter; the context only carries it
    from iop_node.adapters.provider_http import ProviderHttp


@dataclass(frozen=True, slots=True)
class LifecycleFlags:
    """Coarse model lifecycle capabilities of a provider type (catalog flags:
    docs/ARCHITECTURE.md#catalog)."""

    list_models: bool = False
    load_model: bool = False
    unload_model: bool = False
    pull_model: bool = False
    delete_model: bool = False


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine behind a provider, as it tells (docs/ARCHITECTURE.md#qualification-reports):
    its name, its version ("" when it does not say) and the device it runs on ("" when
    it does not say: the node then names its own host's CPU, ``service.engine_probe``)."""

    name: str
    version: str = ""
    device: str = ""


@runtime_checkable
class EngineReporter(Protocol):
    """An adapter that can ask its engine what it is (one cheap GET, never a completion).
    Asked when the provider starts and when its health changes, not per request."""

    async def engine(self) -> EngineInfo: ...


class EventSink(Protocol):
    """Where an adapter sends the pieces of a streamed answer, in order."""

    async def delta(self, delta: Delta) -> None:
        """Send one delta; raises ``RunCancelled`` once the run's consumer is gone."""
        ...


class RunChannel(EventSink, Protocol):
    """Where one run's events go (the edge connection): the executor's domain events
    (``domain.events``), converted to the wire by the channel.

    ``started`` precedes every delta; then ``completed`` or ``failed`` ends the run
    (exactly one). The executor guarantees the order; the channel numbers the events.
    The adapter streams its deltas into the channel itself: the channel stamps the
    run's first delta with the wait on the provider since ``started``
    (``Delta.provider_us``) and keeps the Unix ms it went out in ``first_token_ms``
    (0 while none has), which the run's history records.
    """

    first_token_ms: int

    def started(self, event: Started) -> None: ...

    async def completed(self, completion: Completion) -> None: ...

    async def failed(self, failure: Failed) -> None: ...


class Adapter(Protocol):
    """One provider instance (one ``nodes[].providers[]`` entry) of one provider type.

    ``execute`` returns the run's ``Completion`` or raises a ``RunFailure``
    subclass; it must stop promptly when cancelled (``CancelledError``) and
    abort the provider call. ``spec.deadline`` is the executor's to keep: its one
    deadline scope cancels the call there and reports ``ProviderTimeout``, so an
    adapter opens no scope of its own. ``probe`` must be cheap: never a completion.
    """

    @property
    def name(self) -> str:
        """The provider type (``mock``, ``ollama``, ``vllm`` ...)."""
        ...

    def capabilities(self) -> LifecycleFlags: ...

    async def probe(self) -> ProbeResult: ...

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TokenCounter(Protocol):
    """An adapter whose provider counts a prompt's tokens without generating (the
    ``count_tokens`` operation): its chat template and tokenizer, no generation slot."""

    async def count_tokens(self, spec: ExecutionSpec) -> Completion:
        """``usage.prompt_tokens``: the tokens of ``spec.body`` (a chat body) as the
        provider's chat completion would count them; ``InvalidRequest`` with
        ``provider_status`` 501 where this provider has no tokenizer to ask."""
        ...


@runtime_checkable
class LoadReporter(Protocol):
    """An adapter whose provider loads and unloads models on demand (Ollama): which it
    holds now and how long loads take (docs/ARCHITECTURE.md#warm-aware-scheduling).
    An adapter without it serves every model it lists from memory (vLLM, llama.cpp)."""

    def load_state(self) -> LoadState: ...


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """What the node lends every adapter: pooled HTTP clients, the environment
    (where ``api_key_env`` settings are looked up; keys never travel in configs), and
    the most bytes of an engine's answer the node carries (``max_answer_bytes`` of the
    node's ``max_frame_size``): an adapter reads no more of an answer than that
    (``errors.AnswerTooLarge``)."""

    http: aiohttp.ClientSession
    environ: Mapping[str, str]
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    engines: ProviderHttp | None = None
    """The client of the OpenAI-compatible engines (``adapters/provider_http``), which
    requires it; the node's other adapters use ``http``."""


AdapterFactory = Callable[[ProviderConfig, AdapterContext], Adapter]
"""An adapter class (or a function) registered for one provider type in ``bootstrap``."""


@record
class RunRecord:
    """One run as history keeps it. Times are Unix milliseconds; 0 = did not happen."""

    run_id: str
    model: str
    provider_id: str
    target: str
    operation: str
    stream: bool
    outcome: str  # running | completed | failed | cancelled | rejected
    error_code: str = ""
    error_message: str = ""
    received_ms: int = 0
    started_ms: int = 0
    first_token_ms: int = 0
    finished_ms: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the engine's prompt cache


class RunHistory(Protocol):
    """Run history that survives restarts; never blocks the request path."""

    def run_started(self, record: RunRecord) -> None:
        """Note a run that was admitted (so a crash leaves a trace of it); queued, never
        waited for: the request path does not wait on a disk."""
        ...

    def complete_run(self, record: RunRecord) -> None:
        """Record how a run ended (replaces the started record); queued, as ``run_started``."""
        ...

    async def recent(self, limit: int) -> list[RunRecord]: ...
