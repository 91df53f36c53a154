"""A key's weight and priority, on a real stack (issue 32): two keys weighted 3 and 1
that both flood a model are served 3:1; a key with a higher priority goes first.

The control-plane's CLI does not set a key's weight or priority here, so they reach
the edge the way every key's policy does, in the fleet config, written on its way
(tools/hardening/fair_sharing.py ``PolicyRelay``: between the edge and the real
control-plane, real mTLS both ways, it sets ``weight`` and ``priority`` on the keys it
names and passes every other frame as it is).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "hardening"))
import fair_sharing

pytestmark = pytest.mark.asyncio(loop_scope="module")

Stack = Any


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def relayed(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[tuple[Stack, dict[str, str]]]:
    async with start_stack_factory(tmp_path_factory.mktemp("weights"), fair_sharing.FLEET) as stack:
        async with fair_sharing.relayed(stack) as keys:
            yield stack, keys


async def test_keys_weighted_3_and_1_that_both_flood_are_served_3_to_1(
    relayed: tuple[Stack, dict[str, str]],
) -> None:
    figures = await fair_sharing.weights_scenario(*relayed, 120)
    assert figures["statuses"] == [200]
    heavy, light = figures["heavy_of_first_80"], figures["light_of_first_80"]
    assert 2.0 <= heavy / max(light, 1) <= 4.5, figures  # 3:1; today's FIFO: about 1:1


async def test_a_key_with_a_higher_priority_goes_before_a_burst(
    relayed: tuple[Stack, dict[str, str]],
) -> None:
    figures = await fair_sharing.key_priority_scenario(*relayed, 100)
    assert figures["urgent_status"] == 200
    # the one running when it arrived, and one answer read late at most
    assert figures["light_served_while_urgent_waited"] <= 2, figures
