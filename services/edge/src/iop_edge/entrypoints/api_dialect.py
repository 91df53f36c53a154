"""What differs between the public APIs served over the one run pipeline.

Every inference API the edge serves (OpenAI's chat, completions and
embeddings today; OpenAI Responses and Anthropic Messages are written the same
way) shares the pipeline in ``inference_routes``: authentication, one parse of
the body, the key's slot, dispatch (queue, selection, failover), relaying the
run's events, cancellation on disconnect, one run-log record. A ``Dialect`` is
only the API's own wire: how its request becomes a run (``RunSpec``, whose body
is in the OpenAI shape the node's adapters take), how the run's events are
written back (SSE events as they come, or one JSON answer), and how its errors
look. A dialect does no I/O of its own on the per-token path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from aiohttp import web
from loguru import logger

from iop_edge.domain.events import Completed, Delta
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_edge.domain.usage import Api
from iop_edge.errors import EdgeError
from iop_edge.ports import RunSpec


@dataclass(frozen=True, slots=True)
class DialectRequest:
    """A request read by its dialect: the run to dispatch, what the dialect keeps of
    the request for its answer (``context``: the dialect's own, opaque here), and
    headers its answer carries, streamed or not, error or not (``headers``: name, value
    pairs; the pipeline adds them to the run trace's, with the clamp's)."""

    spec: RunSpec
    context: Any = None
    headers: tuple[tuple[str, str], ...] = ()


DROPPED_TOOLS_HEADER: Final = "x-iop-dropped-tools"
"""The answer's header naming the hosted tools (Responses) or server tools (Messages) that
the pool cannot run and left out of what the model is offered: one policy, one header."""


def dropped_tools_headers(
    api: str, model: str, dropped: Sequence[str]
) -> tuple[tuple[str, str], ...]:
    """The answer's headers for the tools left out (none when none were), logged once."""
    if not dropped:
        return ()
    named = ",".join(dropped)
    logger.info(
        "{} for {}: tools the pool cannot run left out of what it is offered: {}", api, model, named
    )
    return ((DROPPED_TOOLS_HEADER, named),)


class StreamWriter(Protocol):
    """Writes one run's stream in a dialect's SSE events (bytes ready to send)."""

    @property
    def opening(self) -> Callable[[], bytes] | None:
        """What goes out with the status line, before the first delta (a
        ``response.created`` or ``message_start``); ``None`` where nothing does (OpenAI's
        stream starts with its first chunk)."""
        ...

    def delta(self, delta: Delta) -> bytes:
        """The event(s) for one delta; the hot path: no I/O, no awaits."""
        ...

    def closing(self, end: Completed) -> bytes:
        """The last events of a stream that completed (closing chunks, usage, end marker)."""
        ...

    def failure(self, error: EdgeError) -> bytes:
        """The events that end a stream whose run failed after its first byte."""
        ...

    @property
    def settle(self) -> Callable[[], Awaitable[None]] | None:
        """Called after ``closing`` or ``failure``, before their bytes leave: wait until
        what those events say is stored is committed (the Responses API's stored
        answer); raises an ``EdgeError`` when it could not be. ``None`` for a stream
        that stores nothing: its last events leave at once."""
        ...


class Dialect(Protocol):
    """One public API's wire over the shared pipeline."""

    @property
    def operation(self) -> Operation:
        """The operation of the runs it makes (what the run log and metrics record)."""
        ...

    @property
    def api(self) -> Api:
        """The public API it serves: the run log's ``api``, the metrics' ``api`` label."""
        ...

    def read(self, body: dict[str, Any]) -> DialectRequest:
        """The run this body asks for; ``InvalidRequest`` naming the field otherwise."""
        ...

    @property
    def resolve(
        self,
    ) -> Callable[[DialectRequest, ApiKeyEntry | None], Awaitable[DialectRequest]] | None:
        """The request completed with what needs the caller's key or a read (a stored
        conversation to continue); ``None`` for an API whose requests carry all they
        need (OpenAI's, Anthropic's Messages)."""
        ...

    def stream_writer(self, request: DialectRequest, run_id: str, created: int) -> StreamWriter:
        """A writer for one streamed answer (``created``: the request's Unix time)."""
        ...

    async def answer(
        self,
        request: DialectRequest,
        end: Completed,
        deltas: Sequence[Delta],
        run_id: str,
        created: int,
    ) -> bytes:
        """The JSON body of a non-streamed answer."""
        ...

    def error_response(self, exc: EdgeError) -> web.Response:
        """An error before the first byte, in the API's error shape."""
        ...
