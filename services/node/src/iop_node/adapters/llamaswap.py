"""The ``llamaswap`` provider type: llama-swap's OpenAI-compatible proxy, plus which
models it holds in memory (docs/ARCHITECTURE.md#warm-aware-scheduling).

llama-swap starts a llama.cpp server for a model at its first request and stops it to
start another: one at a time unless its groups let several run together. ``GET /running``
(at the proxy's root, beside ``/v1``) names the running ones; it is read with each probe,
after the model list. Only a ``ready`` one is warm: a ``starting`` one is still loading
(llama-swap lists only the ready ones now; older versions listed each with its state).
A model is named there by its id in llama-swap's config, as in ``/v1/models``.
How many it holds at once is in its own config file, which it does not publish: the fleet
says it (``max_loaded_models``; unset: unknown). Its answers say nothing of a load's time,
and the time to an answer's first byte mixes the load with the prompt (and, unstreamed,
with the whole generation), so only warm/cold is reported, no load times.
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

RUNNING_PATH = "/running"  # at the proxy's root (``http://h:8080``), not under ``/v1``
READY = "ready"  # llama-swap's states: starting, ready, stopping, stopped, shutdown


class LlamaSwapAdapter(OpenAICompatAdapter):
    """An OpenAI-compatible adapter that also reports what llama-swap holds (``LoadReporter``)."""

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        super().__init__(config, context, flavor=FLAVORS["llamaswap"])
        max_loaded = config.setting("max_loaded_models", 0)
        self._loads = LoadAccount(max_loaded if isinstance(max_loaded, int) else 0)

    def load_state(self) -> LoadState:
        return self._loads.state()

    async def probe(self) -> ProbeResult:
        result = await super().probe()
        if result.ok:
            await self._read_running()
        return result

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> Completion:
        completion = await super().execute(spec, sink)
        self._loads.answered(spec.target, 0, time.time_ns() // 1_000_000)  # running now
        return completion

    async def _read_running(self) -> None:
        """``/running`` into the account; a proxy that does not answer it keeps the
        account as the answers left it."""
        url = self._base + RUNNING_PATH
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
        if isinstance(document, dict) and isinstance(document.get("running"), list):
            names = _ready(document["running"])
            self._loads.listed([(name, 0) for name in names], time.time_ns() // 1_000_000)


def _ready(rows: list[Any]) -> list[str]:
    """The names of the running models that are ready (a row without a state: ready, as
    an older llama-swap listed only those)."""
    found: list[str] = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        name, state = row.get("model"), row.get("state", READY)
        if isinstance(name, str) and name and state == READY:
            found.append(name)
    return found
