"""What the adapter tests share: an ``EventSink`` that records what an adapter streams.

Every adapter's tests (mock, OpenAI-compatible, llama.cpp, Ollama, vLLM) need the same
sink, so it lives once, beside the ``EventSink`` port it implements, not in each test file.
"""

from __future__ import annotations

import asyncio

from iop_node.domain.runs import Delta
from iop_node.errors import RunCancelled


class RecordingSink:
    """Keeps every delta and sets ``first`` with the first one; with ``fail_after=N`` it
    raises ``RunCancelled`` on delta N+1, as a consumer that went away does."""

    def __init__(self, *, fail_after: int | None = None) -> None:
        self.deltas: list[Delta] = []
        self.first = asyncio.Event()
        self._fail_after = fail_after

    async def delta(self, delta: Delta) -> None:
        if self._fail_after is not None and len(self.deltas) >= self._fail_after:
            raise RunCancelled("consumer gone")
        self.deltas.append(delta)
        self.first.set()

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)
