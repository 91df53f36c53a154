"""An OpenAI-compatible provider that loads models on demand and says which it holds in a
status document of its own (Lemonade's ``/api/v1/health``, llama-swap's ``/running``):
the part of the ``lemonade`` and ``llamaswap`` types they share
(docs/ARCHITECTURE.md#warm-aware-scheduling).

The document is read with each healthy probe, after the model list; an answer marks its
model held until the next read says otherwise. Neither says how long a load took, so only
warm/cold is reported, no load times.
"""

from __future__ import annotations

import time
from typing import ClassVar

from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.domain.health import ProbeResult
from iop_node.domain.model_load import LoadAccount, LoadState
from iop_node.domain.runs import Completion, ExecutionSpec
from iop_node.ports import EventSink


class OnDemandCompatAdapter(OpenAICompatAdapter):
    """``OpenAICompatAdapter`` plus what the provider holds (``LoadReporter``); a type
    names its status document (``STATUS_PATH``) and reads it (``held``)."""

    STATUS_PATH: ClassVar[str]  # under the endpoint's base

    _loads: LoadAccount

    def load_state(self) -> LoadState:
        return self._loads.state()

    async def probe(self) -> ProbeResult:
        result = await super().probe()
        if result.ok:
            await self._read_held()
        return result

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        completion = await super().execute(spec, sink)
        self._loads.answered(spec.target, 0, time.time_ns() // 1_000_000)  # in memory now
        return completion

    async def _read_held(self) -> None:
        """The status document into the account; a provider that does not answer it (or
        with a document of another shape) keeps the account as the answers left it."""
        document = await self._get_document(self.STATUS_PATH)
        held = self.held(document) if isinstance(document, dict) else None
        if held is not None:
            self._loads.listed([(name, 0) for name in held], time.time_ns() // 1_000_000)

    def held(self, document: dict[str, object]) -> list[str] | None:
        """The served names ``document`` says are loaded; ``None``: not a document of
        this provider's shape."""
        raise NotImplementedError
