"""Sharing a pool fairly (issue 32), on a real stack: keys take turns in a model's
queue, an operator key may raise its priority (others are refused the header), and a
batch backfills without slowing interactive requests, every line done exactly once.

The scenarios are tools/hardening/fair_sharing.py's (one copy: the script prints the
figures for any checkout, these tests assert on them). Every mock request takes a fixed
time (``default_tokens`` at ``tokens_per_second``), so what is measured is scheduling.
Counts are asserted, not timings, except the batch's effect on time to first token,
given the slack a busy machine needs.
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
# Answers of a's burst read while the other request waited: the one running when it
# arrived, a's turn before it, and one answer the client may read late (two hundred
# connections are read by one client loop). Today's FIFO: all of a's queue (~190).
TURN_SLACK = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fair_stack(
    tmp_path_factory: pytest.TempPathFactory, start_stack_factory: Any
) -> AsyncIterator[tuple[Stack, fair_sharing.Keys]]:
    async with start_stack_factory(tmp_path_factory.mktemp("fair"), fair_sharing.FLEET) as stack:
        yield stack, await fair_sharing.issue_keys(stack)


async def test_a_key_behind_another_keys_burst_of_200_waits_one_turn(
    fair_stack: tuple[Stack, fair_sharing.Keys],
) -> None:
    figures = await fair_sharing.burst_scenario(*fair_stack, 200)
    assert figures["a_queued_when_b_sent"] >= 100, figures  # b did arrive behind a burst
    assert figures["a_served_while_b_waited"] <= TURN_SLACK, figures
    assert figures["b_status"] == 200
    assert figures["a_statuses"] == [200]
    assert figures["a_fifo_by_wave"], figures  # FIFO within a key


async def test_an_operator_key_raises_its_priority_and_a_tenant_is_refused_the_header(
    fair_stack: tuple[Stack, fair_sharing.Keys],
) -> None:
    figures = await fair_sharing.priority_scenario(*fair_stack, 100)
    assert figures["b_with_header_status"] == 403, figures
    assert figures["operator_status"] == 200
    assert figures["a_served_while_operator_waited"] <= TURN_SLACK, figures


async def test_a_batch_of_500_lines_backfills_without_slowing_interactive_requests(
    fair_stack: tuple[Stack, fair_sharing.Keys],
) -> None:
    figures = await fair_sharing.backfill_scenario(*fair_stack, 500)
    assert figures["batch_status"] == "completed", figures
    assert figures["batch_counts"] == {"total": 500, "completed": 500, "failed": 0}
    assert figures["output_lines"] == figures["output_unique"] == 500  # each line once
    assert figures["output_complete"]
    assert figures["lines_done_while_interactive"] < 500  # the batch did run beside them
    alone, beside = figures["alone"], figures["beside_batch"]
    # Interactive requests never wait for a batch line (one takes 80 ms on the mock):
    # the edge's overhead to the first byte, queueing included, grows by far less than
    # that over the same traffic alone (a busy machine slows both runs alike).
    assert beside["overhead_p90_ms"] < alone["overhead_p90_ms"] + 40, figures
    # Time to first token within 10% of the same traffic alone, plus 10 ms of slack
    # for a busy machine (today's FIFO: the batch adds a line's wait to many requests).
    assert beside["ttft_p50_ms"] <= alone["ttft_p50_ms"] * 1.1 + 10, figures
