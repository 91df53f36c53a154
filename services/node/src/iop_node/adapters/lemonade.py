"""The ``lemonade`` provider type: Lemonade Server's OpenAI-compatible API, plus which
models it holds in memory (docs/ARCHITECTURE.md#warm-aware-scheduling).

Lemonade loads a model at its first request and holds ``max_models.llm`` of them (one by
default: loading another unloads the first). Its ``/api/v1/health`` names the loaded ones
(``all_models_loaded[].model_name``; an older server only ``model_loaded``) and the limit;
it is read with each probe, after the model list. Its answers say nothing of a load's
time, so only warm/cold is reported, no load times.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from iop_node.adapters.answer_read import read_answer
from iop_node.adapters.openai_compat import FLAVORS, PROBE_TIMEOUT_S, OpenAICompatAdapter
from iop_node.adapters.provider_http import ProviderHttpError
from iop_node.domain.health import ProbeResult
from iop_node.domain.model_load import LoadAccount, LoadState
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import Completion, ExecutionSpec
from iop_node.errors import AnswerTooLarge
from iop_node.ports import AdapterContext, EventSink

# Its requests are the OpenAI-compatible adapter's, so it reads the same output lengths,
# capped alike at the edge (tests/security/test_answer_limits.py reads each adapter's).
from iop_proto.engine_fields import OUTPUT_LENGTH_FIELDS as OUTPUT_LENGTH_FIELDS

HEALTH_PATH = "/v1/health"  # under the endpoint's base (``http://h:8000/api``)


class LemonadeAdapter(OpenAICompatAdapter):
    """An OpenAI-compatible adapter that also reports what Lemonade holds (``LoadReporter``)."""

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        super().__init__(config, context, flavor=FLAVORS["lemonade"])
        self._loads = LoadAccount()

    def load_state(self) -> LoadState:
        return self._loads.state()

    async def probe(self) -> ProbeResult:
        result = await super().probe()
        if result.ok:
            await self._read_loaded()
        return result

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        completion = await super().execute(spec, sink)
        self._loads.answered(spec.target, 0, time.time_ns() // 1_000_000)  # in memory now
        return completion

    async def _read_loaded(self) -> None:
        """``/v1/health`` into the account; a server that does not answer it keeps the
        account as the answers left it."""
        url = self._base + HEALTH_PATH
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                response = await self._http.request(
                    "GET", url, headers=self._headers, connect_timeout_s=PROBE_TIMEOUT_S
                )
                async with response:
                    status = response.status
                    body = await read_answer(response, self._max_answer)
            document = json.loads(body) if status < 400 else None
        except (TimeoutError, AnswerTooLarge, ProviderHttpError, ValueError):
            return
        if isinstance(document, dict):
            names, limit = _loaded(document)
            self._loads.limit(limit)
            self._loads.listed([(name, 0) for name in names], time.time_ns() // 1_000_000)


def _loaded(document: dict[str, Any]) -> tuple[list[str], int]:
    """The loaded models' names and how many LLMs it holds at once (0 unknown)."""
    rows = document.get("all_models_loaded")
    if isinstance(rows, list):
        names = [r.get("model_name") for r in rows if isinstance(r, dict)]
    else:
        names = [document.get("model_loaded")]
    limits = document.get("max_models")
    limit = limits.get("llm") if isinstance(limits, dict) else 0
    found = [name for name in names if isinstance(name, str) and name]
    return found, limit if isinstance(limit, int) and limit > 0 else 0
