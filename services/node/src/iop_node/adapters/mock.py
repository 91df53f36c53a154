"""The ``mock`` provider type: a deterministic, paced fake model for tests and load drills.

It answers every operation without a network, so the whole gateway (edge, link,
queues, SSE) can be exercised and failure paths rehearsed on demand. The output
depends only on the request, so tests can assert exact text; the pace is set by
``tokens_per_second`` so streaming and capacity behave like a slow real model.

It is a partner for coding agents and client libraries, answering as a real model
ends a turn:

- **Text.** A short answer, ``default_tokens`` words (32 unless set: the sentence
  of :data:`WORDS`, twice), ending with ``finish_reason: stop`` (Messages:
  ``end_turn``; Responses: ``completed``). A ``max_tokens`` (or
  ``max_completion_tokens``) below that cuts it, ending with ``length``, as a real
  model's limit does. Asked with ``"iop_mock": {"fill": true}``, the answer fills
  ``max_tokens`` instead and ends with ``length``: the mock's old habit, for tests
  of long answers, pacing and truncation.
- **Tool calls.** Offered ``tools`` (``tool_choice`` ``auto`` or absent) while the
  turn it answers is the user's (the last message other than ``system``/``developer``
  is a ``user`` message, and no ``tool`` result came since the last assistant
  message), it calls one tool, ending with ``tool_calls``: the tool whose name the
  user's last message contains (a whole word, the exact case before any case; of
  several, the first named in the last text part that names one; parts that are an
  agent harness's notes, ``<system>`` or ``<system-reminder>`` blocks, are not the
  user's words and never count), else the first tool. ``tool_choice`` ``required``
  calls one whatever the conversation, a named ``tool_choice`` that tool. The
  arguments satisfy the tool's whole JSON schema and are values an agent can run
  harmlessly (``mock_schema``: a ``command``/``cmd`` is
  ``echo iop-mock``, a path ``.``, a ``pattern``/``query`` ``iop-mock``, booleans
  false, only required properties).
- **After a tool result** (a ``tool`` message since the last assistant message), the
  text answer above, ending with ``stop``: the agent's turn is over.
- **Structured output.** Asked for a ``json_schema`` ``response_format`` it answers
  with a valid instance (``mock_schema``), for ``json_object`` with a JSON object.

The same holds streamed and not, and for the Responses and Messages APIs, which the
edge turns into chat completions before the mock sees them.

Request hooks ride in the body, which the edge passes through untouched (chat,
completions, Messages)::

    "iop_mock": {"fill": true,
                 "fail": "provider_error" | "unavailable" | "timeout",
                 "after_tokens": N, "status": 500, "delay_ms": N}

All but ``fill`` are drills, which the edge lets through only from operator keys or with
its ``mock_drills`` setting (the node cannot see keys), and never counts against the
provider (the edge's ``domain/drills.py``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from iop_node import __version__
from iop_node.adapters.mock_schema import instance
from iop_node.domain.health import ProbeResult
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, Delta, ExecutionSpec, Operation, ToolCallDelta, Usage
from iop_node.errors import (
    ConfigError,
    InvalidRequest,
    ProviderFailed,
    ProviderUnavailable,
)
from iop_node.ports import AdapterContext, EngineInfo, EventSink, LifecycleFlags

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog",
    "while", "a", "mock", "model", "streams", "deterministic", "tokens",
)  # fmt: skip
"""The answer cycles through these; token ``i`` is ``WORDS[i % len(WORDS)] + " "``."""

UNPACED_RATE = 1_000_000.0
"""At or above this rate (or at 0) tokens are produced as fast as possible."""

EMBEDDING_DIMENSIONS = 8
STRUCTURED_PIECE = 8
"""A JSON answer streams in pieces of this many characters, each counted as a token."""
FAIL_MODES = ("provider_error", "unavailable", "timeout")
OUTPUT_LENGTH_FIELDS: Final = ("max_completion_tokens", "max_tokens")
"""What the mock reads as an output length, on chat and completions alike (the first
given wins): each is capped by the edge on both routes (``service.limits``)."""


@dataclass(frozen=True, slots=True)
class FailureDrill:
    """The parsed ``iop_mock`` hook of one request: the failure drill, and ``fill``
    (answer with ``max_tokens`` tokens, ending with ``length``)."""

    fail: str = ""
    after_tokens: int = 0
    status: int = 500
    delay_ms: float = 0.0
    fill: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> FailureDrill:
        raw = body.get("iop_mock")
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise InvalidRequest("iop_mock must be an object")
        fail = raw.get("fail", "")
        if fail and fail not in FAIL_MODES:
            raise InvalidRequest(f"iop_mock.fail must be one of {', '.join(FAIL_MODES)}")
        fill = raw.get("fill", False)
        if not isinstance(fill, bool):
            raise InvalidRequest("iop_mock.fill must be true or false")
        return cls(
            fail=fail or "",
            after_tokens=_count(raw.get("after_tokens", 0), "iop_mock.after_tokens"),
            status=_count(raw.get("status", 500), "iop_mock.status"),
            delay_ms=float(_number(raw.get("delay_ms", 0), "iop_mock.delay_ms")),
            fill=fill,
        )


class MockAdapter:
    """A fake provider whose answers are a pure function of the request.

    Settings: ``tokens_per_second`` (default 50; 0 = unpaced) and
    ``default_tokens`` (default 32), the length of a text answer (a smaller
    ``max_tokens`` cuts it; ``iop_mock.fill`` makes it ``max_tokens``). Usage counts
    words: prompt tokens are the whitespace-separated words of the messages (or
    prompt, or embedding input), completion tokens the tokens produced.
    """

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        self._config = config
        self._context = context
        try:
            rate = float(_number(config.setting("tokens_per_second", 50), "tokens_per_second"))
            self._default_tokens = _count(config.setting("default_tokens", 32), "default_tokens")
        except InvalidRequest as exc:
            raise ConfigError(f"provider {config.id}: {exc.message}") from exc
        self._rate = 0.0 if rate >= UNPACED_RATE else rate

    @property
    def name(self) -> str:
        return "mock"

    def capabilities(self) -> LifecycleFlags:
        return LifecycleFlags(list_models=True)

    async def probe(self) -> ProbeResult:
        return ProbeResult(ok=True, models=self._config.models)

    async def engine(self) -> EngineInfo:
        """The mock is its own engine: this node's version, on no device (``EngineReporter``)."""
        return EngineInfo("iop-mock", version=__version__, device="none (simulated)")

    async def aclose(self) -> None:
        """Nothing to release; present because every adapter is closed the same way."""

    async def count_tokens(self, spec: ExecutionSpec) -> Completion:
        """What a chat run of the same body reports as its prompt: the messages' words."""
        words = _prompt_words(spec.body, Operation.CHAT_COMPLETIONS)
        return Completion(usage=Usage.of(words, 0))

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        drill = FailureDrill.from_body(spec.body)
        if drill.delay_ms > 0:
            await asyncio.sleep(drill.delay_ms / 1000)
        if spec.operation is Operation.EMBEDDINGS:
            await self._maybe_fail(drill, produced=0, planned=0)
            return _embeddings(spec)

        return await self._generate(spec, sink, drill)

    async def _generate(
        self, spec: ExecutionSpec, sink: EventSink, drill: FailureDrill
    ) -> Completion:
        body = spec.body
        chat = spec.operation is Operation.CHAT_COMPLETIONS
        prompt_tokens = _prompt_words(body, spec.operation)
        call = _tool_call(body) if chat else None
        if call is not None:
            return await self._call_tool(spec, sink, drill, call, prompt_tokens)
        structured = _structured_answer(body) if chat else None
        if structured is not None:
            return await self._answer_structured(spec, sink, drill, structured, prompt_tokens)

        limit = _max_tokens(body)
        cut = limit is not None and (drill.fill or limit < self._default_tokens)
        planned = limit if cut and limit is not None else self._default_tokens
        finish_reason = "length" if cut else "stop"
        loop = asyncio.get_running_loop()
        start = loop.time()
        pieces: list[str] = []
        for index in range(planned):
            await self._maybe_fail(drill, produced=index, planned=planned)
            await self._pace(loop, start, index)
            piece = WORDS[index % len(WORDS)] + " "
            if spec.stream:
                role = "assistant" if chat and index == 0 else ""
                await sink.delta(Delta(text=piece, role=role))
            else:
                pieces.append(piece)
        await self._maybe_fail(drill, produced=planned, planned=planned)
        if spec.stream and chat and planned == 0:
            await sink.delta(Delta(role="assistant"))  # the client still learns who spoke
        usage = Usage.of(prompt_tokens, planned)
        return self._finish(spec, finish_reason, usage, text="".join(pieces))

    async def _call_tool(
        self,
        spec: ExecutionSpec,
        sink: EventSink,
        drill: FailureDrill,
        call: tuple[str, str],
        prompt_tokens: int,
    ) -> Completion:
        """One call of ``call`` (name, arguments JSON); streamed as a head and (but for
        ``{}``) two argument fragments, so clients reassemble them as for real models."""
        name, arguments = call
        await self._maybe_fail(drill, produced=0, planned=1)
        call_id = f"call_{spec.run_id}"
        if spec.stream:
            head = ToolCallDelta(0, id=call_id, type="function", function_name=name)
            await sink.delta(Delta(role="assistant", tool_calls=(head,)))
            half = len(arguments) // 2 if len(arguments) > 2 else 0  # "{}" goes whole
            for part in (arguments[:half], arguments[half:]):
                if part:
                    fragment = ToolCallDelta(0, function_arguments=part)
                    await sink.delta(Delta(tool_calls=(fragment,)))
        await self._maybe_fail(drill, produced=1, planned=1)
        usage = Usage.of(prompt_tokens, 1)
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        }
        return self._finish(spec, "tool_calls", usage, message=message)

    async def _answer_structured(
        self,
        spec: ExecutionSpec,
        sink: EventSink,
        drill: FailureDrill,
        text: str,
        prompt_tokens: int,
    ) -> Completion:
        """A JSON answer, streamed in pieces of ``STRUCTURED_PIECE`` characters (paced)."""
        pieces = [text[i : i + STRUCTURED_PIECE] for i in range(0, len(text), STRUCTURED_PIECE)]
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index, piece in enumerate(pieces):
            await self._maybe_fail(drill, produced=index, planned=len(pieces))
            await self._pace(loop, start, index)
            if spec.stream:
                await sink.delta(Delta(text=piece, role="assistant" if index == 0 else ""))
        await self._maybe_fail(drill, produced=len(pieces), planned=len(pieces))
        usage = Usage.of(prompt_tokens, len(pieces))
        return self._finish(spec, "stop", usage, text=text)

    async def _pace(self, loop: asyncio.AbstractEventLoop, start: float, index: int) -> None:
        """Sleep until token ``index`` is due; due times come from ``start``, so no drift."""
        if self._rate <= 0:
            await asyncio.sleep(0)  # stay cancellable even when the sink never yields
            return
        await asyncio.sleep(max(0.0, start + (index + 1) / self._rate - loop.time()))

    async def _maybe_fail(self, drill: FailureDrill, *, produced: int, planned: int) -> None:
        """Run the failure drill once ``after_tokens`` tokens (or all of them) are out."""
        if not drill.fail or produced < min(drill.after_tokens, planned):
            return
        if drill.fail == "provider_error":
            raise ProviderFailed(
                f"mock provider error {drill.status} after {produced} tokens",
                provider_status=drill.status,
            )
        if drill.fail == "unavailable":
            raise ProviderUnavailable(f"mock provider unavailable after {produced} tokens")
        # "timeout": hang like a stuck provider until the deadline (or a cancel) ends the run.
        await asyncio.get_running_loop().create_future()

    def _finish(
        self,
        spec: ExecutionSpec,
        finish_reason: str,
        usage: Usage,
        *,
        text: str = "",
        message: dict[str, Any] | None = None,
    ) -> Completion:
        if spec.stream:
            return Completion(finish_reason=finish_reason, usage=usage)
        return Completion(
            finish_reason=finish_reason,
            usage=usage,
            result=_completion_body(spec, finish_reason, usage, text=text, message=message),
        )


def _completion_body(
    spec: ExecutionSpec,
    finish_reason: str,
    usage: Usage,
    *,
    text: str,
    message: dict[str, Any] | None,
) -> dict[str, Any]:
    """The OpenAI non-streaming response body for a chat or text completion."""
    if spec.operation is Operation.CHAT_COMPLETIONS:
        object_, id_ = "chat.completion", f"chatcmpl-{spec.run_id}"
        choice: dict[str, Any] = {
            "index": 0,
            "message": message or {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        object_, id_ = "text_completion", f"cmpl-{spec.run_id}"
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": id_,
        "object": object_,
        "created": int(time.time()),
        "model": spec.target,
        "choices": [choice],
        "usage": _usage_body(usage),
    }


def _usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _embeddings(spec: ExecutionSpec) -> Completion:
    """A unit vector per input, derived from a hash of the input: same input, same vector."""
    body = spec.body
    raw = body.get("input")
    inputs: list[Any]
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        inputs = [raw]  # one string, or one pre-tokenised input
    elif isinstance(raw, list) and raw and all(isinstance(item, str | list) for item in raw):
        inputs = raw
    else:
        raise InvalidRequest("input must be a string, a list of strings or token arrays")
    dimensions = _count(body.get("dimensions", EMBEDDING_DIMENSIONS), "dimensions")
    if dimensions == 0:
        raise InvalidRequest("dimensions must be at least 1")
    as_base64 = body.get("encoding_format") == "base64"
    data: list[dict[str, Any]] = []
    for index, item in enumerate(inputs):
        vector = _vector(json.dumps(item), dimensions)
        embedding: Any = vector
        if as_base64:
            embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    prompt_tokens = sum(_words(item) for item in inputs)
    usage = Usage.of(prompt_tokens, 0)
    result = {
        "object": "list",
        "data": data,
        "model": spec.target,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return Completion(usage=usage, result=result)


def _vector(key: str, dimensions: int) -> list[float]:
    values: list[float] = []
    block = 0
    while len(values) < dimensions:
        digest = hashlib.sha256(f"{block}:{key}".encode()).digest()
        values.extend(n / 2**31 - 1.0 for n in struct.unpack("<8I", digest))
        block += 1
    values = values[:dimensions]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _tool_call(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The function the mock calls and its arguments (JSON valid for the function's
    ``parameters``), or ``None`` to answer in text: no tools, ``tool_choice`` ``none``,
    or (``auto``, the default) a turn that is not the user's (see the module's rules)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise InvalidRequest("tools must be a list of objects")
    functions = [t.get("function") if isinstance(t.get("function"), Mapping) else {} for t in tools]
    names = [str(f.get("name", "")) for f in functions]
    if isinstance(choice, Mapping):
        name = str((choice.get("function") or {}).get("name", "")) or str(choice.get("name", ""))
        if name not in names or not name:
            raise InvalidRequest(f"tool_choice names an unknown function {name!r}")
        index = names.index(name)
    elif choice in (None, "auto", "required"):
        if choice != "required" and not _users_turn(body.get("messages")):
            return None
        index = _named_tool(body.get("messages"), names)
    else:
        raise InvalidRequest("tool_choice must be none, auto, required or a named function")
    if not names[index]:
        raise InvalidRequest(f"tools[{index}].function.name is missing")
    arguments = instance(functions[index].get("parameters"))
    return names[index], json.dumps(arguments, separators=(",", ":"))


INSTRUCTIONS: Final = frozenset({"system", "developer"})


def _users_turn(messages: Any) -> bool:
    """Whether the model answers the user: the last message but instructions (Claude
    Code puts a ``system`` one after the user's) is the user's, and no tool result came
    since the last assistant message (a Messages tool result with text beside it
    becomes a ``tool`` then a ``user`` message)."""
    if not isinstance(messages, list):
        return False
    roles = [m.get("role") for m in messages if isinstance(m, Mapping)]
    turn = [r for r in roles if r not in INSTRUCTIONS]
    if not turn or turn[-1] != "user":
        return False
    since = turn[len(turn) - turn[::-1].index("assistant") :] if "assistant" in turn else turn
    return "tool" not in since


def _named_tool(messages: Any, names: list[str]) -> int:
    """The index of the tool that the user's last message names, else 0 (module rules)."""
    texts = list(_user_texts(messages))
    for text in reversed(texts):
        for exact in (True, False):
            found = [
                (match.start(), index)
                for index, name in enumerate(names)
                if name and (match := _word(name, exact).search(text))
            ]
            if found:
                return min(found)[1]
    return 0


def _word(name: str, exact: bool) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])", 0 if exact else re.IGNORECASE)


HARNESS_NOTES: Final = ("<system>", "<system-reminder>")
"""How the text parts an agent adds beside its user's words start: Claude Code's reminders
(which list its tools and agents by name) and the edge's notes for system messages inside
``messages``. Naming a tool there is the harness's doing, not the user's asking."""


def _user_texts(messages: Any) -> Iterator[str]:
    """The user's own text parts of the last ``user`` message, in order."""
    users = [m for m in messages or () if isinstance(m, Mapping) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            text = part.get("text") if isinstance(part, Mapping) else None
            if isinstance(text, str) and not text.lstrip().startswith(HARNESS_NOTES):
                yield text


def _structured_answer(body: Mapping[str, Any]) -> str | None:
    """The JSON text a ``response_format`` asks for (``None``: plain text is asked for)."""
    wanted = body.get("response_format")
    if not isinstance(wanted, Mapping):
        return None
    if wanted.get("type") == "json_schema":
        spec = wanted.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        return json.dumps(instance(schema), separators=(",", ":"))
    if wanted.get("type") == "json_object":
        return json.dumps({"answer": " ".join(WORDS[:4])}, separators=(",", ":"))
    return None


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in OUTPUT_LENGTH_FIELDS:
        value = body.get(key)
        if value is not None:
            return _count(value, key)
    return None


def _prompt_words(body: Mapping[str, Any], operation: Operation) -> int:
    if operation is Operation.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise InvalidRequest("messages must be a list")
        return sum(_words(m.get("content")) for m in messages if isinstance(m, Mapping))
    return _words(body.get("prompt"))


def _words(content: Any) -> int:
    """Whitespace-separated words of a content value (string, parts, token ids)."""
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, int) and not isinstance(content, bool):
        return 1  # a token id of a pre-tokenised prompt
    if isinstance(content, list):
        return sum(_words(part) for part in content)
    if isinstance(content, Mapping):
        return _words(content.get("text"))
    return 0


def _number(value: Any, field: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidRequest(f"{field} must be a non-negative number")
    return value


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{field} must be a non-negative integer")
    return value
