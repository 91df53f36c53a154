"""An incremental Server-Sent Events reader for OpenAI-style streams over HTTP.

OpenAI-compatible servers stream ``data: {json}`` events separated by blank
lines and end with ``data: [DONE]``. This reader takes the body as the network
delivers it (``iter_any``: no wait for a full line buffer, so the first token
is forwarded as soon as it arrives), splits lines with ``bytes.split`` (C speed,
no per-byte Python loop) and yields each event's data exactly once, undecoded,
so the caller parses every payload a single time.

Handled: ``\\n`` and ``\\r\\n`` line ends, data spread over several ``data:``
lines (joined with ``\\n`` as the SSE spec says), comments (``: ping``, used as
keep-alives), other fields (``event:``, ``id:``, ``retry:``: ignored, OpenAI
streams carry nothing in them), and ``[DONE]``. A lone ``\\r`` as a line end is
not: no OpenAI-compatible server sends it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from iop_node.adapters.http_exchange import ProviderResponse
from iop_node.errors import AnswerTooLarge
from iop_proto.framing import DEFAULT_MAX_ANSWER_BYTES

DONE = b"[DONE]"
MAX_EVENT_BYTES = DEFAULT_MAX_ANSWER_BYTES
"""Past it an event is refused (``AnswerTooLarge``) before it is whole: one frame must
carry it on to the edge, and a server that never ends a line is held to it too."""


async def iter_sse_data(
    response: ProviderResponse, *, max_event_bytes: int = MAX_EVENT_BYTES
) -> AsyncGenerator[bytes, None]:
    """Yield the data of each event of ``response``'s body, until ``[DONE]`` or the end.

    An async generator (an ``AsyncIterator`` that can be ``aclose``d): wrap it in
    ``contextlib.aclosing`` when the loop may stop early.

    Events without a data field (comments only, ``event:`` alone) are skipped.
    If the body ends without the blank line that closes its last event, that
    event is still yielded: some servers omit it, and a cut-off JSON payload
    then fails to parse in the caller instead of vanishing silently.
    Raises ``AnswerTooLarge`` for an event larger than ``max_event_bytes``.

    The body's reader (``iter_any``) is closed when this ends: at ``[DONE]``, the body's
    last chunk maybe on its way still, at the body's end, or when this is closed.
    """
    partial: list[bytes] = []  # the pieces of a line that has not ended yet
    partial_size = 0
    data: list[bytes] = []  # the data lines of the event being read
    data_size = 0
    async with contextlib.aclosing(response.iter_any()) as chunks:
        async for chunk in chunks:
            if b"\n" not in chunk:
                partial.append(chunk)
                partial_size += len(chunk)
                if partial_size + data_size > max_event_bytes:
                    raise AnswerTooLarge(max_event_bytes)
                continue
            if partial:
                partial.append(chunk)
                chunk = b"".join(partial)
                partial.clear()
            lines = chunk.split(b"\n")
            tail = lines.pop()  # after the last \n: the start of the next line
            if tail:
                partial.append(tail)
            partial_size = len(tail)
            for line in lines:
                if line.endswith(b"\r"):
                    line = line[:-1]
                if not line:  # a blank line dispatches the event
                    if data:
                        payload = data[0] if len(data) == 1 else b"\n".join(data)
                        data.clear()
                        data_size = 0
                        if payload == DONE:
                            return
                        yield payload
                    continue
                if line.startswith(b"data:"):
                    value = line[6:] if line.startswith(b"data: ") else line[5:]
                    data.append(value)
                    data_size += len(value) + 1
                    if data_size > max_event_bytes:
                        raise AnswerTooLarge(max_event_bytes)
                elif line == b"data":  # a field name alone means an empty value
                    data.append(b"")
                # anything else is a comment (":...") or a field OpenAI streams do not use
    if partial:
        line = b"".join(partial)
        if line.endswith(b"\r"):
            line = line[:-1]
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
    if data:
        payload = b"\n".join(data)
        if payload != DONE:
            yield payload
