"""A fleet file in the legacy `openai.model_routes` shape serves the same requests
(docs/ARCHITECTURE.md#pool-configuration)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI

pytestmark = pytest.mark.asyncio(loop_scope="module")

LEGACY_FLEET: dict[str, object] = {
    "openai": {
        "model_routes": [
            {
                "model": "mock-small",
                "adapter": "mock",
                "target": "mock-small",
                "node": "node-a",
                "capacity": 2,
            },
            {
                "model": "mock-small",
                "adapter": "mock",
                "target": "mock-small-b",
                "node": "node-b",
                "capacity": 2,
            },
        ]
    }
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def legacy_stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    start_stack = request.getfixturevalue("start_stack_factory")
    async with start_stack(Path(tmp_path_factory.mktemp("legacy")), LEGACY_FLEET) as stack:
        yield stack


async def test_legacy_routes_serve_chat_on_both_nodes(legacy_stack: Any) -> None:
    cp_log = "".join(legacy_stack.services["control-plane"].log)
    assert "is deprecated: converted to models[mock-small].providers[node-a-mock]" in cp_log
    async with AsyncOpenAI(base_url=legacy_stack.api_url, api_key="x", max_retries=0) as sdk:
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["mock-small"]
        answer = await sdk.chat.completions.create(
            model="mock-small", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert answer.model == "mock-small"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3
