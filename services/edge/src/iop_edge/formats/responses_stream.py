"""A run's stream as OpenAI Responses server-sent events, in OpenAI's order and shapes.

``response.created`` and ``response.in_progress`` open the stream; each output
item is announced (``response.output_item.added``, and for a message or
reasoning its ``response.content_part.added``), then its deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), then closed with its ``.done``
events before the next item opens; ``response.completed`` (or
``response.incomplete``) ends it with the whole Response. A failure after the
first byte ends it with ``error`` and ``response.failed``. Every event carries
``sequence_number`` and goes out with its ``event:`` line, as OpenAI sends them.

A custom tool's call is a ``custom_tool_call`` item: the engine writes its input as the
JSON arguments of a function (``responses_tools``), so the input is sent whole when the
call is done (``response.custom_tool_call_input.delta``, then ``.done``), not as
fragments of that JSON.

The per-token path (a text delta of the open message) is a byte template with
only the sequence number and the JSON-escaped text written in; everything
else goes through a dict and the C encoder. No I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.domain.events import Completed, Delta, ToolCallDelta
from iop_edge.errors import EdgeError
from iop_edge.formats.responses_output import (
    Call,
    OutputShape,
    Turn,
    call_item,
    call_item_id,
    message_id,
    message_item,
    output_text_part,
    reasoning_id,
    reasoning_item,
    response_error,
    response_object,
)
from iop_proto import json_codec

_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_TEXT_DELTA: Final = "response.output_text.delta"
_TEXT_HEAD: Final = (
    b"event: response.output_text.delta\ndata: "
    b'{"type":"response.output_text.delta","sequence_number":'
)
_TEXT_END: Final = b',"logprobs":[]}\n\n'
MESSAGE, REASONING, CALL = "message", "reasoning", "function_call"


@dataclass(slots=True)
class _Item:
    """An output item being streamed."""

    kind: str
    output_index: int
    item_id: str
    call_index: int = 0
    custom: bool = False  # a custom tool's call (CALL items)
    sealed: str | None = None  # the encrypted_content of a reasoning item, once sealed
    parts: list[str] = field(default_factory=list)
    call: Call = field(default_factory=Call)
    text_tail: bytes = b""  # the text-delta template after the sequence number (messages)


class ResponseEventStream:
    """Encodes one run's stream; ``final`` is the whole Response once the stream ended."""

    __slots__ = (
        "_created",
        "_echo",
        "_items",
        "_now",
        "_open",
        "_run_id",
        "_seq",
        "_shape",
        "final",
        "turn",
    )

    def __init__(
        self,
        echo: dict[str, Any],
        run_id: str,
        created: int,
        shape: OutputShape,
        now: Callable[[], float],
    ) -> None:
        """``now``: the clock (Unix seconds) that dates ``completed_at``."""
        self._echo = echo
        self._run_id = run_id
        self._created = created
        self._shape = shape
        self._now = now
        self._seq = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self.turn = Turn()
        self.final: dict[str, Any] | None = None

    def opening(self) -> bytes:
        snapshot = self._response("in_progress", [])
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def delta(self, delta: Delta) -> bytes:
        item = self._open
        if (
            item is not None
            and item.kind == MESSAGE
            and delta.text
            and not (delta.reasoning_text or delta.tool_calls or delta.finish_reason)
            and delta.usage is None
        ):
            # The common token: a template, the sequence number and one escaped string.
            item.parts.append(delta.text)
            seq = self._seq
            self._seq = seq + 1
            text = _ENCODER.encode(delta.text).encode()
            return _TEXT_HEAD + str(seq).encode() + item.text_tail + text + _TEXT_END
        turn = self.turn  # the items keep the text; the turn, how the run ended
        turn.finish_reason = delta.finish_reason or turn.finish_reason
        if delta.usage is not None:
            turn.usage = delta.usage
        out: list[bytes] = []
        if delta.reasoning_text:
            item = self._item(out, REASONING)
            item.parts.append(delta.reasoning_text)
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    **_at(item),
                    content_index=0,
                    delta=delta.reasoning_text,
                )
            )
        if delta.text:
            item = self._item(out, MESSAGE)
            item.parts.append(delta.text)
            out.append(
                self._event(
                    _TEXT_DELTA, **_at(item), content_index=0, delta=delta.text, logprobs=[]
                )
            )
        for part in delta.tool_calls:
            self._call_part(out, part)
        return b"".join(out)

    def closing(self, end: Completed) -> bytes:
        """``.done`` events of the open item, then ``response.completed`` or ``.incomplete``."""
        turn = self.turn
        turn.finish_reason = end.finish_reason or turn.finish_reason
        turn.usage = end.usage or turn.usage
        reason = turn.incomplete_reason
        out: list[bytes] = []
        if not self._items:
            self._item(out, MESSAGE)  # a run that said nothing still answers with a message
        self._close(out, "incomplete" if reason else "completed")
        status = "incomplete" if reason else "completed"
        self.final = self._response(
            status,
            self._output(status),
            turn.usage_object(),
            reason,
            completed_at=None if reason else int(self._now()),
        )
        out.append(self._event(f"response.{status}", response=self.final))
        return b"".join(out)

    def failure(self, error: EdgeError) -> bytes:
        """The open item closed as incomplete, an ``error`` event, then ``response.failed``."""
        out: list[bytes] = []
        self._close(out, "incomplete")
        self.final = self._response(
            "failed", self._output("incomplete"), None, error=response_error(error)
        )
        out.append(self._event("error", **error_event_fields(error)))
        out.append(self._event("response.failed", response=self.final))
        return b"".join(out)

    # -- items ---------------------------------------------------------------------------

    def _item(self, out: list[bytes], kind: str) -> _Item:
        """The open item if it is a ``kind`` (message or reasoning), else a new one (the
        open one closed first: OpenAI streams items one after the other)."""
        item = self._open
        if item is not None and item.kind == kind:
            return item
        self._close(out, "completed")
        index = len(self._items)
        run_id = self._run_id
        again = any(i.kind == kind for i in self._items)  # a model that goes back and forth
        if kind == MESSAGE:
            item_id = message_id(run_id)
            item = _Item(kind, index, f"{item_id}_{index}" if again else item_id)
            item.text_tail = (
                f',"item_id":{json.dumps(item.item_id)},"output_index":{index},'
                '"content_index":0,"delta":'
            ).encode()
            added = message_item(item.item_id, None, "in_progress")
            part: dict[str, Any] = output_text_part("")
        else:
            item_id = reasoning_id(run_id)
            item = _Item(kind, index, f"{item_id}_{index}" if again else item_id)
            added = reasoning_item(item.item_id, None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        self._items.append(item)
        self._open = item
        out.append(self._event("response.output_item.added", output_index=index, item=added))
        out.append(
            self._event("response.content_part.added", **_at(item), content_index=0, part=part)
        )
        return item

    def _call_part(self, out: list[bytes], part: ToolCallDelta) -> None:
        item = self._open
        if item is None or item.kind != CALL or item.call_index != part.index:
            known = next(
                (i for i in self._items if i.kind == CALL and i.call_index == part.index), None
            )
            if known is not None:  # a late fragment of a call already closed: kept, not resent
                _merge(known.call, part)
                return
            self._item_for_call(out, part)
            return
        _merge(item.call, part)
        if part.function_arguments and not item.custom:
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    **_at(item),
                    delta=part.function_arguments,
                )
            )

    def _item_for_call(self, out: list[bytes], part: ToolCallDelta) -> None:
        """A new function_call item; its name and call id are in the added event, and the
        arguments of its first fragment follow as a delta."""
        self._close(out, "completed")
        custom = self._shape.is_custom(part.function_name)
        item_id = call_item_id(self._run_id, part.index, custom)
        item = _Item(CALL, len(self._items), item_id, part.index, custom)
        _merge(item.call, part)
        arguments, item.call.arguments = item.call.arguments, ""
        self._items.append(item)
        self._open = item
        added = call_item(item.item_id, item.call, "in_progress", self._shape)
        out.append(
            self._event("response.output_item.added", output_index=item.output_index, item=added)
        )
        item.call.arguments = arguments
        if arguments and not custom:
            out.append(
                self._event("response.function_call_arguments.delta", **_at(item), delta=arguments)
            )

    def _close(self, out: list[bytes], status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(item.parts)
        if item.kind == MESSAGE:
            part = output_text_part(text)
            out.append(
                self._event(
                    "response.output_text.done",
                    **_at(item),
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._event("response.content_part.done", **_at(item), content_index=0, part=part)
            )
        elif item.kind == REASONING:
            out.append(
                self._event("response.reasoning_text.done", **_at(item), content_index=0, text=text)
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    **_at(item),
                    content_index=0,
                    part={"type": "reasoning_text", "text": text},
                )
            )
        elif item.custom:
            text = call_item(item.item_id, item.call, status, self._shape)["input"]
            if text:
                out.append(
                    self._event("response.custom_tool_call_input.delta", **_at(item), delta=text)
                )
            out.append(self._event("response.custom_tool_call_input.done", **_at(item), input=text))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **_at(item),
                    name=self._shape.tools.ref(item.call.name).name,
                    arguments=item.call.arguments,
                )
            )
        out.append(
            self._event(
                "response.output_item.done",
                output_index=item.output_index,
                item=self._done_item(item, status),
            )
        )

    def _done_item(self, item: _Item, status: str) -> dict[str, Any]:
        text = "".join(item.parts)
        if item.kind == MESSAGE:
            return message_item(item.item_id, text, status)
        if item.kind == REASONING:
            if item.sealed is None:
                item.sealed = self._shape.sealed(text)
            return reasoning_item(item.item_id, text, status, item.sealed)
        return call_item(item.item_id, item.call, status, self._shape)

    def _output(self, status: str) -> list[dict[str, Any]]:
        """Every item, closed by now: the last with ``status``, those closed early (another
        item followed) completed."""
        last = len(self._items) - 1
        return [
            self._done_item(item, status if i == last else "completed")
            for i, item in enumerate(self._items)
        ]

    # -- framing -------------------------------------------------------------------------

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        return response_object(
            self._echo,
            self._run_id,
            self._created,
            status=status,
            output=output,
            usage=usage,
            incomplete_reason=incomplete,
            error=error,
            completed_at=completed_at,
        )

    def _event(self, kind: str, **fields: Any) -> bytes:
        seq = self._seq
        self._seq = seq + 1
        return sse_event(kind, seq, fields)


def _at(item: _Item) -> dict[str, Any]:
    return {"item_id": item.item_id, "output_index": item.output_index}


def _merge(call: Call, part: ToolCallDelta) -> None:
    call.call_id = call.call_id or part.id
    call.name += part.function_name
    call.arguments += part.function_arguments


def sse_event(kind: str, sequence_number: int, fields: dict[str, Any]) -> bytes:
    """One Responses stream event as SSE: an event line, then its data."""
    payload = {"type": kind, "sequence_number": sequence_number, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + json_codec.dumps(payload) + b"\n\n"


def error_event_fields(error: EdgeError) -> dict[str, Any]:
    """An ``error`` event's fields. OpenAI sends the error's fields at the top; the Open
    Responses specification (its ErrorStreamingEvent) wants them in ``error``: both."""
    payload = {"code": error.code, "message": error.message, "param": error.param}
    return {**payload, "error": {"type": error.type, **payload}}
