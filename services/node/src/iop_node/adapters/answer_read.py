"""Reading an engine's answer in bounded steps: never more than a frame can carry.

An answer goes on to the edge in one frame, so one larger than ``max_answer_bytes``
cannot arrive whatever the node does with it. It is refused as soon as that is known
(the ``Content-Length`` announced, or the bytes read so far), before it is parsed or
framed: the run fails (``AnswerTooLarge``) and the caller closes the response, so the
engine stops sending. Reading is chunk by chunk, each a short step of the event loop,
and what is kept never passes the limit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from iop_node.errors import AnswerTooLarge


class Body(Protocol):
    """A body read as it arrives: aiohttp's ``StreamReader``, ``ProviderResponse``."""

    def iter_any(self) -> AsyncIterator[bytes]: ...


class Answer(Protocol):
    """An HTTP response being read: aiohttp's ``ClientResponse`` or ``provider_http``'s."""

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> Body: ...


async def read_answer(response: Answer, limit: int) -> bytes:
    """The body of ``response``; ``AnswerTooLarge`` once it announces or passes ``limit``."""
    announced = response.content_length
    if announced is not None and announced > limit:
        raise AnswerTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
