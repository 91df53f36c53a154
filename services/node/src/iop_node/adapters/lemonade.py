"""The ``lemonade`` provider type: Lemonade Server's OpenAI-compatible API, plus which
models it holds in memory (docs/ARCHITECTURE.md#warm-aware-scheduling).

Lemonade loads a model at its first request and holds ``max_models.llm`` of them (one by
default: loading another unloads the first). Its ``/api/v1/health`` names the loaded ones
(``all_models_loaded[].model_name``; an older server only ``model_loaded``) and the limit;
it is read with each probe (``OnDemandCompatAdapter``).
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


class LemonadeAdapter(OnDemandCompatAdapter):
    """An OpenAI-compatible adapter that also reports what Lemonade holds (``LoadReporter``)."""

    STATUS_PATH = "/v1/health"  # under the endpoint's base (``http://h:8000/api``)

    def __init__(self, config: ProviderConfig, context: AdapterContext) -> None:
        super().__init__(config, context, flavor=FLAVORS["lemonade"])
        self._loads = LoadAccount()

    def held(self, document: dict[str, Any]) -> list[str]:
        """The loaded models' names; how many LLMs it holds at once (0 unknown) goes into
        the account on the way, as Lemonade says it in the same document."""
        rows = document.get("all_models_loaded")
        if isinstance(rows, list):
            names = [r.get("model_name") for r in rows if isinstance(r, dict)]
        else:
            names = [document.get("model_loaded")]
        limits = document.get("max_models")
        limit = limits.get("llm") if isinstance(limits, dict) else 0
        self._loads.limit(limit if isinstance(limit, int) and limit > 0 else 0)
        return [name for name in names if isinstance(name, str) and name]
