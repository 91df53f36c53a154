"""The limits on what a request may be and ask for, chosen here once and derived, not copied.

Size. A run travels to its node as one frame, and a frame may not pass
``max_frame_size`` (edge settings; 16 MiB by default, and the nodes must take as
much). The HTTP body limit follows from it: ``max_frame_size -
RUN_FRAME_HEADROOM``, the headroom being room for what a frame carries around
the body (envelope, ids, names) with plenty to spare. A body may still grow when
it is written again (``1e15`` is written ``1000000000000000.0``), so before a
provider slot is taken the dispatcher serialises the body once (``RunBody``), measuring it
as it goes, and refuses a run whose frame would not fit: a 413, and no slot or queue
place is ever held for it. Batch lines are held to the same body
limit when their batch is created.

Once. What a provider gets is that serialisation completed for it, not the body
written again: ``RunBody`` holds the body's bytes without the fields written per
provider (``model``, ``stream``, ``stream_options``), and ``for_provider`` adds the
served name and, for an OpenAI-compatible type, the type's streaming switches
(``iop_proto.engine_fields``): the node posts those bytes as they came
(``RunOrder.body_prepared``), never parsing them, with the prompt's block hashes
(``prompt_blocks``, hashed once here, for cache affinity and the node's cache account).
Only a body with a field its provider's type is not sent is written again, without it
(the engines' own fields sent to another engine; smaller, so still inside the bound).

Nesting. JSON from clients is read with ``MAX_JSON_DEPTH`` levels at most (the
shared codec's ``MAX_DEPTH``): deeper is a 400 naming the limit, at parse time,
instead of a body that reads but cannot be written again.

Output. An output-length field (``max_tokens`` / ``max_completion_tokens`` of a chat
body, ``max_tokens`` of a completion; Responses' ``max_output_tokens`` and Messages'
``max_tokens`` arrive here as the chat body's ``max_tokens``) must be a positive integer
below 2**31; one above the model's ``max_output_tokens`` (fleet file;
``DEFAULT_MAX_OUTPUT_TOKENS`` when unset) is lowered to it (``bound_answer``), and
the answer says so in ``CLAMP_HEADER`` (``32000->4096``). Agents size the field for the
largest model they know (opencode asks 32000, Claude Code 32000 or more), not for the
pool's: refusing would fail every request, while the cap still keeps a client from
holding a slot for hours. Anything else (a string, a bool, zero, 2**31) is a 400
naming the field, as OpenAI answers. ``OUTPUT_TOKEN_FIELDS`` is the one table of output
lengths: every field a node's adapter reads as one (``OUTPUT_LENGTH_FIELDS`` of each
adapter module: the mock reads ``max_completion_tokens`` on ``/v1/completions`` too) is
capped on every route that adapter serves, and a test derives that from the adapters'
own constants.

Answer size. An answer returns to the edge as one frame too, and some parameters
multiply its size far past what the output length says: log probabilities (llama.cpp's
``n_probs`` of 100000 puts the whole vocabulary on every token: 65 MB for 16 tokens of
SmolLM2). ``ANSWER_SIZE_CAPS`` bounds each such field (``bound_answer`` too, one pass
over a body's bounded fields): over its cap, or not a count, is a 400 naming the field
and the cap, before any slot is taken.
The caps are OpenAI's own (``top_logprobs`` at most 20), and engines' fields of the same
meaning take the same; ``n`` and ``best_of`` are held to 1 (not every provider returns
several choices). A non-streamed answer may still pass a frame (thousands of tokens
with 20 log probabilities each, an engine answering more than asked): it fails at the
node, that run alone (docs/ARCHITECTURE.md#answers-bounded-like-requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from iop_edge.domain.fleet import Operation
from iop_edge.errors import InvalidRequest, RequestTooLarge
from iop_proto import json_codec
from iop_proto.engine_fields import ALLOWED, STREAM_FIELDS, provider_body, stream_switches
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.prefix import body_blocks

RUN_FRAME_HEADROOM: Final = 64 * 1024
"""Bytes of a frame kept free of the HTTP body: at least ``RUN_FRAME_OVERHEAD`` plus the
served name, written twice; the rest absorbs a body that grows a little when written again."""
RUN_FRAME_OVERHEAD: Final = 4 * 1024
"""A bound of what a run's frame holds besides its body and served name: the envelope
(message id, run id, time) and the run request's other fields (public model id, at most
256 characters; provider id, at most 63; the adapter's name; deadline and flags)."""
MAX_JSON_DEPTH: Final = json_codec.MAX_DEPTH

OUTPUT_TOKEN_FIELDS: Final[Mapping[Operation, tuple[str, ...]]] = {
    Operation.CHAT_COMPLETIONS: ("max_tokens", "max_completion_tokens"),
    Operation.COMPLETIONS: ("max_tokens", "max_completion_tokens"),
    Operation.EMBEDDINGS: (),
    Operation.COUNT_TOKENS: (),
}
CLAMP_HEADER: Final = "x-iop-max-tokens-clamped"
"""The response header of a request whose output length was lowered to the model's cap."""
MAX_OUTPUT_TOKENS_ASKED: Final = 2**31 - 1
"""The largest output length a request may ask (then lowered to the cap): OpenAI's bound."""
_MODEL_KEY: Final = b'{"model":'
_PER_PROVIDER: Final = STREAM_FIELDS | {"model"}
"""The fields ``RunBody`` writes for each provider, not with the rest of the body."""
SWITCHES_SLACK: Final = 64
"""Bytes the streaming switches of a prepared body may take beyond the client's own
``stream`` and ``stream_options`` (``,"stream":false`` and ``"include_usage":true``)."""
_PROMPTED: Final = frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS})
"""The operations whose prompt an engine caches: their orders carry its block hashes."""

MAX_LOGPROBS: Final = 20
"""OpenAI's ``top_logprobs`` maximum, and the cap of every field that asks as many
alternatives per token (vLLM's own default ``max_logprobs`` is 20 as well)."""
ANSWER_SIZE_CAPS: Final[Mapping[str, int]] = {
    "top_logprobs": MAX_LOGPROBS,  # chat: alternatives per output token
    "logprobs": MAX_LOGPROBS,  # completions: an integer of the same meaning; chat: a bool
    "n_probs": MAX_LOGPROBS,  # llama.cpp's name for top_logprobs
    "prompt_logprobs": MAX_LOGPROBS,  # vLLM: alternatives per *prompt* token
    "n": 1,  # choices (the HTTP APIs refuse n != 1 first; this holds batch lines to it)
    "best_of": 1,  # candidates generated per choice
}
"""Every request field that multiplies an answer's size, and its largest value."""


def max_body_bytes(max_frame_size: int) -> int:
    """The HTTP body limit that goes with a frame limit (and a batch line's)."""
    return max_frame_size - RUN_FRAME_HEADROOM


DEFAULT_MAX_BODY_BYTES: Final = max_body_bytes(DEFAULT_MAX_FRAME_SIZE)


class RunBody:
    """A request body serialised once, before a provider is chosen, and measured against
    the frame limit: everything but the fields written per provider (``model``: the
    chosen provider's served name, written first, docs/ARCHITECTURE.md#target-rewrite;
    ``stream`` and ``stream_options``)."""

    __slots__ = ("_blocks", "_names", "fields", "frame_bytes", "rest", "switches")

    def __init__(
        self,
        body: Mapping[str, Any],
        served: Iterable[str] = (),
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        """``RequestTooLarge`` unless the run fits in a frame whichever provider runs it
        (``served``: the model's served names, one per provider).

        ``frame_bytes``, the most a frame carrying it can take: the body with the longest
        served name, the slack of that provider's streaming switches, the served name
        again (the order's target) and the rest of the frame (``RUN_FRAME_OVERHEAD``);
        0 for a model without providers (nothing can run it)."""
        self.fields = body  # the body as a dict (not changed: the client's, clamped)
        # the body without the per-provider fields, as a JSON object
        rest = self.rest = json_codec.dumps(
            {k: v for k, v in body.items() if k not in _PER_PROVIDER}
        )
        # the client's own ``stream`` fields, as a JSON object
        own = {k: body[k] for k in STREAM_FIELDS if k in body}
        switches = self.switches = json_codec.dumps(own) if own else b"{}"
        self._blocks: tuple[int, ...] | None = None
        # What ``for_provider`` writes around the served name: the ``model`` key, the
        # closing brace, and the members of ``rest`` and ``switches`` (without braces).
        unnamed = len(_MODEL_KEY) + 1
        if rest != b"{}":
            unnamed += len(rest) - 1
        if switches != b"{}":
            unnamed += len(switches) - 1
        # each served name as JSON, written once: measured here, put in the body by
        # ``for_provider``
        names = self._names = {name: json_codec.dumps(name) for name in served}
        # the served name twice: in the body (as JSON) and as the order's target
        named = max((len(text) + len(name.encode()) for name, text in names.items()), default=0)
        self.frame_bytes = unnamed + named + SWITCHES_SLACK + RUN_FRAME_OVERHEAD if named else 0
        if self.frame_bytes > max_frame_size:
            raise RequestTooLarge(
                f"The request is too large: it takes up to {self.frame_bytes} bytes on its way"
                f" to the provider, over this server's limit of {max_frame_size} bytes."
            )

    def for_provider(
        self, provider_type: str, served: str, operation: Operation, stream: bool
    ) -> tuple[bytes, bool, tuple[int, ...]]:
        """The order's ``body_json``, ``body_prepared`` and ``prompt_blocks`` for a provider
        of ``provider_type`` serving ``served``: an OpenAI-compatible type gets its body
        prepared (its fields, the served name, its streaming switches), any other type
        the client's body with the served name, for its adapter to read."""
        fields = ALLOWED.get((provider_type, operation))
        blocks: tuple[int, ...] = ()
        if fields is None:  # not an OpenAI-compatible type, or count_tokens
            switches, prepared = self.switches, False
        else:
            blocks = self.prompt_blocks() if operation in _PROMPTED else ()
            if not self.fields.keys() - _PER_PROVIDER <= fields:
                # a field this type is not sent: the body written again without it
                named = {**self.fields, "model": served}
                body = provider_body(named, provider_type, operation, stream)
                return json_codec.dumps(body), True, blocks
            forced = stream_switches(self.fields, provider_type, operation, stream)
            switches, prepared = json_codec.dumps(forced) if forced else b"{}", True
        # the target rewrite (docs/ARCHITECTURE.md#target-rewrite): the served name first
        # (a name outside ``served``: the fleet renamed it while the request waited)
        name = self._names.get(served) or json_codec.dumps(served)
        parts: list[bytes | memoryview] = [_MODEL_KEY + name]
        with memoryview(self.rest) as rest:  # one copy of a body of megabytes, not two
            if self.rest != b"{}":
                parts += (b",", rest[1:-1])
            if switches != b"{}":
                parts += (b",", switches[1:-1])
            parts.append(b"}")
            return b"".join(parts), prepared, blocks

    def prompt_blocks(self) -> tuple[int, ...]:
        """The prompt's block hashes (``iop_proto.prefix``), hashed on first use, once:
        the same for cache affinity and for every attempt's order."""
        if self._blocks is None:
            self._blocks = tuple(body_blocks(self.fields))
        return self._blocks


@dataclass(frozen=True, slots=True)
class OutputClamp:
    """An output length lowered to the model's cap: what was asked, what runs."""

    asked: int
    cap: int

    @property
    def header(self) -> str:
        """The value of ``CLAMP_HEADER``: ``asked->cap``."""
        return f"{self.asked}->{self.cap}"


_MULTIPLIES: Final = " (it multiplies the answer's size; this server's limit)"
_BOUNDS: Final[Mapping[Operation, tuple[tuple[str, int, int, bool], ...]]] = {
    operation: (
        *((field, 1, MAX_OUTPUT_TOKENS_ASKED, True) for field in lengths),
        *(
            (field, 0, cap, False)
            for field, cap in ANSWER_SIZE_CAPS.items()
            if operation in _PROMPTED  # embeddings and token counts answer no tokens
        ),
    )
    for operation, lengths in OUTPUT_TOKEN_FIELDS.items()
}
"""Each operation's bounded fields, output lengths first: (field, lowest, highest,
whether it is an output length, lowered to the model's cap)."""


def bound_answer(
    operation: Operation, body: dict[str, Any], cap: int, *, cap_when_unasked: bool = False
) -> tuple[dict[str, Any], OutputClamp | None]:
    """``body`` with each output-length field held to the model's ``cap``, and what was
    lowered (the largest asked; ``None`` when nothing was, and ``body`` itself comes back
    unless ``cap_when_unasked`` gave it one). ``cap_when_unasked``: a body that asks no
    length is given ``max_tokens`` = ``cap`` (the fleet described the model's limits: an
    engine left to its own default, such as llama.cpp's, generates until its context is
    full; said in no header, since nothing the client asked was changed).

    ``InvalidRequest`` naming the field, in OpenAI's words, unless each output length is
    absent, null, or an integer from 1 to 2**31 - 1, and each ``ANSWER_SIZE_CAPS`` field
    absent, null, or a count within its cap (chat's ``logprobs`` is a boolean: the switch
    of ``top_logprobs``, which carries the count).
    """
    lengths = OUTPUT_TOKEN_FIELDS[operation]
    if cap_when_unasked and lengths and all(body.get(field) is None for field in lengths):
        body = {**body, lengths[0]: cap}
    clamp: OutputClamp | None = None
    for field, low, high, is_length in _BOUNDS[operation]:
        value = body.get(field)
        if value is None or (field == "logprobs" and type(value) is bool):
            continue
        if type(value) is not int:
            raise InvalidRequest(
                f"Invalid type for '{field}': expected an integer, but got {_kind(value)} instead.",
                param=field,
                code="invalid_type",
            )
        if value < low:
            raise InvalidRequest(
                f"Invalid '{field}': integer below minimum value. Expected a value >= {low}, "
                f"but got {_shown(value)} instead.",
                param=field,
                code="integer_below_min_value",
            )
        if value > high:
            raise InvalidRequest(
                f"Invalid '{field}': integer above maximum value. Expected a value <= {high}, "
                f"but got {_shown(value)} instead{'' if is_length else _MULTIPLIES}.",
                param=field,
                code="integer_above_max_value",
            )
        if is_length and value > cap:
            if clamp is None:
                body = dict(body)  # the client's body is never changed in place
            body[field] = cap
            if clamp is None or value > clamp.asked:
                clamp = OutputClamp(value, cap)
    return body, clamp


def _kind(value: object) -> str:
    kinds = {bool: "a boolean", str: "a string", float: "a decimal number"}
    kinds.update({list: "an array", dict: "an object"})
    return kinds.get(type(value), "another type")


def _shown(value: int) -> str:
    """An integer for a message: a 4,000-digit one is cut, not quoted whole."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"
