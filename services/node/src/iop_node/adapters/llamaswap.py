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

from typing import Any

from iop_node.adapters.on_demand_compat import OnDemandCompatAdapter
from iop_node.adapters.openai_compat import FLAVORS
from iop_node.domain.model_load import LoadAccount
from iop_node.domain.provider import ProviderConfig
from iop_node.ports import AdapterContext

# Its requests are the OpenAI-compatible adapter's, so it reads the same output lengths,
# capped alike at the edge (tests/security/test_answer_limits.py reads each adapter's).
from iop_proto.engine_fields import OUTPUT_LENGTH_FIELDS as OUTPUT_LENGTH_FIELDS

READY = "ready"  # llama-swap's states: starting, ready, stopping, stopped, shutdown


class LlamaSwapAdapter(OnDemandCompatAdapter):
    """An OpenAI-compatible adapter that also reports what llama-swap holds (``LoadReporter``)."""

    STATUS_PATH = "/running"  # at the proxy's root (``http://h:8080``), not under ``/v1``

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        super().__init__(config, context, flavor=FLAVORS["llamaswap"])
        max_loaded = config.setting("max_loaded_models", 0)
        self._loads = LoadAccount(max_loaded if isinstance(max_loaded, int) else 0)

    def held(self, document: dict[str, Any]) -> list[str] | None:
        """The names of the running models that are ready (a row without a state: ready,
        as an older llama-swap listed only those); ``None`` without a ``running`` list."""
        rows = document.get("running")
        if not isinstance(rows, list):
            return None
        found: list[str] = []
        for row in rows:
            if not isinstance(row, dict):
                continue
            name, state = row.get("model"), row.get("state", READY)
            if isinstance(name, str) and name and state == READY:
                found.append(name)
        return found
