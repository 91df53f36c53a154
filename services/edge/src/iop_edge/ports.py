"""The edge's ports: what the HTTP API needs from the dispatcher, the keys and the history.

The HTTP layer knows nothing of nodes, pools or protobuf framing; it asks
``RunService`` for a run and reads its events. Unit tests drive the HTTP layer
with small fakes of these protocols.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.events import Accepted, Failed, RunEvent
from iop_edge.domain.fleet import ApiKeyEntry, Fleet, ModelEntry, Operation
from iop_edge.domain.history import HistoryRange, HistoryRow
from iop_edge.domain.key_rates import Gauge, Refusal, Scopes
from iop_edge.domain.leases import LeaseGrant, LineReply
from iop_edge.domain.outliers import Phase
from iop_edge.domain.queue import NO_SHARE, Share
from iop_edge.domain.usage import UsageRow
from iop_edge.domain.warmth import LoadReport
from iop_edge.errors import EdgeError


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A client request the HTTP layer has validated; ``body`` was parsed once."""

    model: str  # the public model id
    operation: Operation
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    batch: bool = False  # batch lines yield to interactive requests (worker issue)
    # Cache affinity (docs/ARCHITECTURE.md#cache-affinity): the session the request names
    # (domain.session_key, scoped to its API key ``scope``), and whether its run's response
    # id names the session's next turn (Responses: ``previous_response_id``).
    session: str | None = None
    scope: str = ""
    chained: bool = False
    # The body asks the mock provider for a failure drill (``iop_mock``, domain/drills.py),
    # allowed for this caller: its run's failure is never counted against the provider.
    drill: bool = False
    # Its turn in the model's queue (docs/ARCHITECTURE.md#fair-queueing): the key's id,
    # weight and priority (an operator key's ``x-iop-priority`` header overrides it).
    share: Share = NO_SHARE
    # An operator's ``x-iop-provider``: the one provider it may run on (domain.pin); "": any.
    pin: str = ""
    # The edge's span of the request as a W3C traceparent, for the node's spans to join
    # (docs/ARCHITECTURE.md#traces); "" while tracing is off.
    traceparent: str = ""


class RunEvents(Protocol):
    """One request's run, from admission to its one outcome (``RequestRun``): its events
    in order, ending with ``Completed`` or ``Failed`` (converted from the wire once, by
    the node listener). Whatever ends the request ends it through the run."""

    run_id: str  # the client's id (X-Request-Id): its first attempt's, once dispatched

    # These four: the attempt in progress (or the last one).
    @property
    def provider_id(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def target(self) -> str: ...
    @property
    def node_wait_ms(self) -> int:
        """Its wait in the node's queue, as its start said (0 before it started)."""
        ...

    async def open(self) -> None:
        """Take a slot (maybe after a wait in the model's queue) and start the run.

        Raises ``NoProviderAvailable``, ``QueueFull``, ``QueueTimeout``, ``ShuttingDown``,
        or the error the run was ended with meanwhile (``KeyRevoked``); the run has ended
        then, and holds nothing.
        """
        ...

    async def next_events(self) -> Sequence[RunEvent]:
        """The events that arrived since the last call, oldest first, waiting while none
        has: those the node sent together come together (a relay writes them as one
        chunk). The run's end is the last event; after it, an empty sequence. A start
        is not among them: the run keeps what it says (``node_wait_ms``)."""
        ...

    @property
    def ended(self) -> bool:
        """The run has its outcome: nothing is left to cancel."""
        ...

    async def cancel(self, reason: str, error: EdgeError | None = None) -> None:
        """End the run (client gone, key revoked): the node aborts the provider call,
        slots free; ``error``: what the client sees instead of a cancellation."""
        ...

    def error(self, failed: Failed) -> EdgeError:
        """What the client sees for the run's failure ``failed``."""
        ...

    def attempt_records(self) -> tuple[AttemptRecord, ...]:
        """Each attempt so far, oldest first (more than one: the run failed over)."""
        ...


class RunService(Protocol):
    """Dispatch: selection, the per-model queue, target rewrite, the node link."""

    def admit(self, spec: RunSpec) -> RunEvents:
        """The request's run, before any wait; ``RunEvents.open`` dispatches it.

        Raises ``ModelNotFound``, ``ShuttingDown`` and the request's own errors (too
        large, an operation none of the model's providers offers).
        """
        ...


class FleetView(Protocol):
    """The fleet config in force (``FleetHolder``), for whoever only reads it."""

    @property
    def current(self) -> Fleet: ...


class OutlierView(Protocol):
    """A provider's outlier ejection state, read only (``domain.outliers.OutlierState``)."""

    @property
    def phase(self) -> Phase: ...
    @property
    def consecutive_failures(self) -> int: ...
    @property
    def ejections(self) -> int: ...
    @property
    def until(self) -> float:
        """While ejected: when the cooldown ends, Unix seconds."""
        ...


class SlotView(Protocol):
    """One provider's live state, read only: what a ``ProviderSlot`` shows without the
    methods that change it (``take``, ``release``, ``update`` are the dispatcher's)."""

    @property
    def provider_id(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def category(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def connected(self) -> bool: ...
    @property
    def health(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def load_ratio(self) -> float: ...
    @property
    def usable(self) -> bool: ...
    @property
    def node_queued(self) -> int: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def lifecycle(self) -> Mapping[str, bool]: ...
    @property
    def detail(self) -> str: ...
    @property
    def outlier(self) -> OutlierView: ...
    @property
    def operations(self) -> frozenset[Operation]: ...
    @property
    def refused(self) -> frozenset[Operation]: ...
    @property
    def cache(self) -> CacheReport: ...
    @property
    def engine(self) -> Mapping[str, str | int]: ...
    @property
    def warmth(self) -> LoadReport | None: ...


class ProviderView(Protocol):
    """The live pool, read only (``ProviderRegistry``): the catalog and the peer guard
    look, only the registry and the dispatcher change slots."""

    def slot(self, provider_id: str) -> SlotView | None: ...

    def slots(self) -> Sequence[SlotView]:
        """Every provider of the fleet, in the fleet file's order."""
        ...


class QueueView(Protocol):
    """How many requests wait for a model (``Dispatcher``)."""

    def queued(self, model_id: str) -> int: ...


class RunLink(Protocol):
    """A run in flight, as the peer guard checks events against it and the node
    listener hands them to it."""

    @property
    def node_id(self) -> str: ...

    @property
    def link(self) -> object:
        """The connection the run was dispatched on (compared by identity)."""
        ...

    def deliver(self, event: RunEvent | Accepted) -> None:
        """An event of the attempt from its node."""
        ...


class RunView(Protocol):
    """The runs in flight (``Dispatcher``)."""

    @property
    def runs(self) -> Mapping[str, RunLink]:
        """By the id of the attempt on their node; read only."""
        ...


class Catalog(Protocol):
    """The read-only catalog (docs/ARCHITECTURE.md#catalog): no control operations."""

    def models(self) -> list[ModelEntry]: ...

    def model(self, model_id: str) -> ModelEntry | None: ...

    def provider_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        """``/iop/v1/catalog/providers`` rows: provider_id, node_id, type, category, health,
        capacity, in_flight, load_ratio, queued, models, lifecycle_capabilities, operations
        (what it offers now) and refused_operations (it answered 501 for them), and the
        outlier ejection state (outlier_state, ejected, ejected_until_ms,
        consecutive_failures).

        With a ``key`` that has a model list (and is not an operator's): only the
        providers serving one of its models, each listing only those models.
        """
        ...

    def model_views(self, key: ApiKeyEntry | None = None) -> list[dict[str, Any]]:
        """``/iop/v1/catalog/models`` rows: id, display_name, providers,
        available_providers, available (and unavailable_reason when not), operations (what
        some provider of it offers), queued; only the models ``key`` may use, when given."""
        ...

    def any_available(self) -> bool:
        """At least one provider can take work (``/readyz``)."""
        ...

    def offers(self, model_id: str, operation: Operation) -> bool:
        """A usable provider of the model offers ``operation`` (``count_tokens``: whether
        a tokenizer can answer, or a one-token run must)."""
        ...


class KeyRing(Protocol):
    """API keys from the control-plane's policy (hashes only)."""

    @property
    def configured(self) -> bool:
        """A fleet config has arrived: until then every request is refused (503)."""
        ...

    @property
    def open(self) -> bool:
        """No key was ever issued: the API is open (and says so in the log)."""
        ...

    def lookup(self, presented_key: str) -> ApiKeyEntry | None: ...


@dataclass(frozen=True, slots=True)
class KeySlot:
    """One slot of an API key's ``max_concurrent``, held by one request."""

    key_id: str
    slot_id: str


class KeyConcurrency(Protocol):
    """API keys' slots of ``max_concurrent`` in the store every edge of the fleet shares,
    so that N edges hold a key to its limit, not to N times it
    (docs/ARCHITECTURE.md#limits-and-affinity-across-edges). Without one, each edge's
    ``KeySlots`` counts alone."""

    async def acquire(self, key_id: str, limit: int) -> KeySlot | None:
        """A slot of ``key_id`` when fewer than ``limit`` are held; ``None`` when not."""
        ...

    async def release(self, slot: KeySlot) -> None:
        """Give ``slot`` back; called exactly once per slot ``acquire`` gave, and never
        raises (a slot that cannot be given back now frees itself later)."""
        ...


class KeyRateStore(Protocol):
    """Where API keys' rates and budgets are counted (docs/ARCHITECTURE.md#limits-per-key):
    this edge's memory, or the store every edge of the fleet shares. Both apply
    ``domain.key_rates`` to what they hold; ``scopes`` are the limits a request is held to
    (the key's, the key's on its model), read from the fleet at each call."""

    async def admit(
        self, key_id: str, scopes: Scopes, input_tokens: int
    ) -> tuple[tuple[Gauge, ...], Refusal | None]:
        """Take one request and ``input_tokens`` (an estimate) unless a limit refuses;
        the standing after it (for the headers), and the refusal when there is one."""
        ...

    def charge(self, key_id: str, scopes: Scopes, input_tokens: int, output_tokens: int) -> None:
        """Count tokens used beyond what was taken (negative: the estimate was high).
        Never waits: a shared store writes them within its flush interval."""
        ...


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt of a run: its own run id on one provider (docs/ARCHITECTURE.md#failover)."""

    run_id: str
    provider_id: str
    node_id: str
    outcome: str  # completed | failed | cancelled | running (the request ended before it)
    error_code: str = ""
    started_ms: int = 0  # Unix ms
    duration_ms: int = 0


@dataclass(frozen=True, slots=True)
class EdgeRunRecord:
    """What the edge keeps of a run it dispatched. Times are Unix ms; 0 = did not happen."""

    run_id: str
    model: str
    provider_id: str
    node_id: str
    operation: str
    stream: bool
    outcome: str  # completed | failed | cancelled | rejected
    status: int  # the HTTP status the client got
    error_code: str = ""
    received_ms: int = 0
    queue_wait_ms: int = 0
    ttft_ms: int = 0
    duration_ms: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    key_id: str = ""  # the API key that asked; "" while the API is open (no keys)
    attempts: tuple[AttemptRecord, ...] = ()  # every attempt, oldest first; () = not dispatched
    cached_tokens: int = 0  # of prompt_tokens, served from the engine's prompt cache
    api: str = ""  # the public API it came through (domain.usage.Api); "" = recorded before
    trace_id: str = ""  # its OpenTelemetry trace (32 hex digits); "" = not traced


class RunLog(Protocol):
    """The edge's run history (SQLite, or PostgreSQL shared by edges), written off the
    request path, once per run."""

    def record(self, record: EdgeRunRecord) -> None:
        """Queue one finished run. Synchronous, so it cannot suspend: callers rely on it
        completing even while their task is being cancelled."""
        ...

    async def recent(self, limit: int, key_id: str | None = None) -> list[EdgeRunRecord]:
        """The ``limit`` newest runs, newest first; only ``key_id``'s when it is given."""
        ...

    async def usage(self, since_ms: int, key_id: str | None = None) -> list[UsageRow]:
        """The runs received since ``since_ms`` (Unix ms), added up by key, model and
        API, unwritten ones included; only ``key_id``'s when it is given."""
        ...

    async def history(self, span: HistoryRange) -> list[HistoryRow]:
        """The runs received in ``span``, added up by time bucket, model and provider,
        unwritten ones included (``domain.history``)."""
        ...


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One turn of a Responses API conversation, kept for ``GET /v1/responses/{id}`` and
    ``previous_response_id``.

    ``response_json`` is the Response object as the client got it; ``input_json`` this
    turn's own input items (each with an id), not the conversation before it: that is
    the chain of ``previous_id`` links, each turn stored once, so storage grows with
    what clients send, not with the square of a conversation. ``depth`` counts the
    links above it (0: it starts a conversation). ``deleted_at`` (Unix seconds, 0 while
    it is not deleted): a deleted turn is not found any more, but its items stay as
    long as a later turn continues from it.
    """

    response_id: str
    key_id: str  # the API key that made it; another key's lookups find nothing
    created_at: int  # Unix seconds
    response_json: bytes
    input_json: bytes
    previous_id: str | None = None
    depth: int = 0
    deleted_at: int = 0

    @property
    def deleted(self) -> bool:
        return self.deleted_at != 0

    @property
    def size(self) -> int:
        """The bytes it takes, as counted against its key's quota."""
        return len(self.response_json) + len(self.input_json)


class ResponseStore(Protocol):
    """Stored Responses (SQLite, or PostgreSQL shared by edges), each readable only by the
    key that made it, until it expires or is deleted."""

    @property
    def max_depth(self) -> int:
        """The most turns a conversation may chain; a request continuing past it is refused."""
        ...

    def admit(self, key_id: str, incoming: int) -> None:
        """Raise ``StorageQuotaExceeded`` when storing ``incoming`` more bytes would take
        ``key_id`` over its quota (checked before a ``store: true`` request runs); on
        PostgreSQL, ``StorageUnavailable`` while the store is known to be down."""
        ...

    async def keep(self, response: StoredResponse) -> None:
        """Store a turn; it is committed to disk when this returns."""
        ...

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        """The turn if it exists, is ``key_id``'s, and is neither deleted nor expired."""
        ...

    async def chain(self, response_id: str, key_id: str) -> list[StoredResponse] | None:
        """The conversation up to ``response_id``: its turns, the first first, ending with
        it; ``None`` where ``get`` finds nothing (earlier turns may be deleted or expired:
        a conversation continued from keeps them)."""
        ...

    async def delete(self, response_id: str, key_id: str) -> bool:
        """Delete a turn (committed when this returns); False when ``get`` finds nothing."""
        ...


class BatchLeases(Protocol):
    """What workers do with batches over IOP (implemented by ``BatchService``)."""

    async def worker_registered(self, worker_id: str) -> None:
        """The worker (re)connected, with no other connection live: leases it held
        before are free again."""
        ...

    async def connection_ended(self, worker_id: str, lease_ids: Iterable[str]) -> None:
        """A worker's connection ended: the leases granted on it (still its own) are free."""
        ...

    async def lease(self, worker_id: str) -> LeaseGrant:
        """The oldest batch needing work, or an empty grant."""
        ...

    async def renew(self, lease_id: str) -> LeaseGrant:
        """Extend a lease; raises ``LeaseLost`` when it expired, was taken or is cancelling."""
        ...

    async def release(self, lease_id: str, finished: bool) -> None: ...

    async def lease_holder(self, lease_id: str) -> str | None:
        """The worker id holding this lease; ``None`` when no batch holds it (expired and
        taken over, released, or never granted)."""
        ...

    async def run_line(self, lease_id: str, line_number: int) -> LineReply:
        """Run one line through normal dispatch (batch priority); a finished line is
        answered from storage, never run twice."""
        ...
