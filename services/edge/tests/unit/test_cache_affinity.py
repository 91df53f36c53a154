"""Cache affinity's parts: session keys from the agents' real requests, the prefix index's
bounds and expiry, and the preference rule with its bounded load and its wait."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from iop_edge.domain.affinity import PREFIX, SESSION, AffinityPolicy, CacheAffinity
from iop_edge.domain.cache_report import CacheReport
from iop_edge.domain.pool import AVAILABLE, ProviderSlot
from iop_edge.domain.prefix_index import PrefixIndex
from iop_edge.domain.session_key import session_key, successor_key
from iop_edge.formats.responses_output import response_id
from iop_proto.prefix import BLOCK_CHARS, body_blocks

REQUESTS = Path(__file__).resolve().parents[4] / "tests" / "agents" / "requests"


def recorded(agent: str) -> dict[str, Any]:
    """The first request the agent sent to mock-small, as recorded by make test-agents."""
    requests = json.loads((REQUESTS / f"{agent}.json").read_text())["mock-small"]
    return dict(requests[0])


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ("codex", "session-id"),  # the header, which is also its prompt_cache_key
        ("codex-ws", "session-id"),  # the WebSocket handshake's header
        ("claude", "X-Claude-Code-Session-Id"),
        ("opencode", "x-session-affinity"),
    ],
)
def test_each_agent_s_real_request_names_its_session(agent: str, expected: str) -> None:
    request = recorded(agent)
    headers = {k.lower(): v for k, v in request["headers"].items()}
    body = request.get("body") or {}
    key = session_key(headers, body, "key-1")
    assert key == f"key-1\x00{headers[expected.lower()]}"


def test_the_body_alone_names_the_session_as_the_agents_put_it_there() -> None:
    codex = recorded("codex")["body"]
    assert session_key({}, codex) == f"\x00{codex['prompt_cache_key']}"
    claude = recorded("claude")["body"]
    session = json.loads(claude["metadata"]["user_id"])["session_id"]
    assert session_key({}, claude) == f"\x00{session}"
    old_claude = {"metadata": {"user_id": "user_abc_account_def_session_1234-5678"}}
    assert session_key({}, old_claude) == "\x001234-5678"


@pytest.mark.parametrize("agent", ["aider", "continue"])
def test_agents_that_name_no_session_get_none(agent: str) -> None:
    request = recorded(agent)
    assert session_key(request["headers"], request.get("body") or {}) is None


def test_a_responses_chain_finds_the_key_its_previous_turn_was_placed_under() -> None:
    run_id = "0123abcd"
    body = {"previous_response_id": response_id(run_id)}
    assert session_key({}, body, "k") == successor_key(run_id, "k")
    # Another API key naming the same response id is another session.
    assert session_key({}, body, "other") != successor_key(run_id, "k")


def test_user_and_safety_identifier_come_last() -> None:
    assert session_key({}, {"user": "u1", "prompt_cache_key": "c"}) == "\x00c"
    assert session_key({}, {"user": "u1"}) == "\x00user:u1"
    assert session_key({}, {"safety_identifier": "s", "user": "u1"}) == "\x00safety_identifier:s"
    assert session_key({"x-session-id": "h"}, {"prompt_cache_key": "c"}) == "\x00h"


# ---------------------------------------------------------------- the prefix index


def chain(text: str) -> list[int]:
    return body_blocks({"prompt": text})  # a prompt string is its own text


def test_the_index_matches_the_longest_run_of_leading_blocks_per_holder() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=60)
    shared = "s" * (3 * BLOCK_CHARS)
    index.record(chain(shared + "a" * BLOCK_CHARS * 2), "A", now=0)
    index.record(chain(shared + "b" * BLOCK_CHARS), "B", now=0)
    found = index.matches(chain(shared + "a" * BLOCK_CHARS * 3), now=1)
    assert found == {"A": 5, "B": 3}
    assert index.matches(chain("z" * BLOCK_CHARS * 4), now=1) == {}


def test_the_index_is_bounded_least_recently_sent_first() -> None:
    index = PrefixIndex(max_blocks=6, ttl_s=60)
    old, new = chain("o" * BLOCK_CHARS * 4), chain("n" * BLOCK_CHARS * 4)
    index.record(old, "A", now=0)
    index.record(new, "B", now=1)
    assert len(index) == 6
    # The oldest blocks went: the old prompt's start, so it matches nothing any more.
    assert index.matches(old, now=2) == {}
    assert index.matches(new, now=2) == {"B": 4}


def test_a_holder_not_sent_a_prefix_within_the_ttl_no_longer_matches_it() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=10)
    blocks = chain("t" * BLOCK_CHARS * 3)
    index.record(blocks, "A", now=0)
    index.record(blocks, "B", now=5)
    assert index.matches(blocks, now=12) == {"B": 3}
    assert index.matches(blocks, now=16) == {}


# ---------------------------------------------------------------- the preference rule


def slot(pid: str, capacity: int = 1, in_flight: int = 0) -> ProviderSlot:
    made = ProviderSlot(pid, "n", capacity=capacity, connected=True, health=AVAILABLE)
    made.own_in_flight = in_flight
    return made


PROMPT = "p" * BLOCK_CHARS * 8


def test_nothing_to_reuse_gives_no_preference_and_the_seed_rule_decides() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    members = [slot("a"), slot("b")]
    assert affinity.prefer("m", members, None, (), now=0) is None
    assert affinity.prefer("m", members, "s1", (), now=0) is None  # a new session
    assert affinity.prefer("m", members, None, chain(PROMPT), now=0) is None  # a new prefix


def test_a_session_goes_back_to_its_provider_even_when_another_is_less_loaded() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    a, b, c = slot("a", capacity=2, in_flight=1), slot("b", capacity=2), slot("c", capacity=2)
    affinity.placed("m", a, "s1", chain(PROMPT), now=0)
    preference = affinity.prefer("m", [a, b, c], "s1", chain(PROMPT + "more"), now=1)
    assert preference is not None
    assert (preference.slot, preference.reason, preference.matched_blocks) == (a, SESSION, 8)


def test_without_a_session_the_longest_prefix_wins_and_the_node_s_word_first() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    a, b, c = slot("a"), slot("b"), slot("c")
    system = "s" * BLOCK_CHARS * 3
    affinity.placed("m", a, None, chain(system), now=0)  # only the system prompt
    affinity.placed("m", b, None, chain(system + "x" * BLOCK_CHARS * 3), now=0)
    asked = chain(system + "x" * BLOCK_CHARS * 3 + "next turn" * 50)
    preference = affinity.prefer("m", [a, b, c], None, asked, now=1)
    assert preference is not None
    assert (preference.slot, preference.reason) == (b, PREFIX)
    # c's node reports its engine served the same 6 blocks: the node's word wins the tie.
    full = chain(system + "x" * BLOCK_CHARS * 3)
    c.cache = CacheReport(held={full[-1]: len(full)})
    preference = affinity.prefer("m", [a, b, c], None, asked, now=1)
    assert preference is not None
    assert preference.slot is c
    # Another model on the same providers shares no cache.
    assert affinity.prefer("other", [a, b], None, asked, now=1) is None


def test_a_hot_session_fills_its_provider_to_the_bound_then_spills() -> None:
    policy = AffinityPolicy(load_factor=1.25)
    affinity = CacheAffinity(policy)
    members = [slot("a", capacity=4), slot("b", capacity=4), slot("c", capacity=4)]
    affinity.placed("m", members[0], "hot", chain(PROMPT), now=0)
    for _ in range(30):  # thirty turns of one session in flight at once
        preference = affinity.prefer("m", members, "hot", chain(PROMPT), now=1)
        chosen = preference.slot if preference is not None else min(members, key=_ratio)
        chosen.own_in_flight += 1
        pool = sum(s.in_flight for s in members)
        # The bound: its share times the factor, and one more while it had a free slot.
        assert chosen.in_flight <= math.ceil(policy.load_factor * pool * 4 / 12) + 1, pool
    assert {s.provider_id for s in members if s.in_flight} == {"a", "b", "c"}


def _ratio(member: ProviderSlot) -> float:
    return member.in_flight / member.capacity


def test_a_spilled_session_is_remembered_where_it_landed_and_stays() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    a, b = slot("a", in_flight=1), slot("b")
    affinity.placed("m", a, "s1", chain(PROMPT), now=0)
    affinity.waiting("a", 1)  # a already has a waiter of its own: over its bound
    assert affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1) is None
    affinity.placed("m", b, "s1", chain(PROMPT), now=1)  # the seed's rule put it on b
    affinity.waiting("a", -1)
    a.own_in_flight = 0
    preference = affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=2)
    assert preference is not None
    assert preference.slot is b


def test_the_wait_is_the_re_prefill_it_saves_by_the_node_s_rate_and_bounded() -> None:
    policy = AffinityPolicy(max_wait_s=5.0, default_prefill_ms_per_token=1.0)
    affinity = CacheAffinity(policy)
    a, b = slot("a", in_flight=1), slot("b")
    affinity.placed("m", a, "s1", chain(PROMPT), now=0)
    preference = affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1)
    assert preference is not None
    tokens = 8 * BLOCK_CHARS / policy.chars_per_token
    assert preference.wait_s == pytest.approx(tokens * 1.0 / 1000)
    a.cache = CacheReport(prefill_ms_per_token=4.0)
    preference = affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1)
    assert preference is not None
    assert preference.wait_s == pytest.approx(tokens * 4.0 / 1000)
    a.cache = CacheReport(prefill_ms_per_token=1000.0)
    preference = affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1)
    assert preference is not None
    assert preference.wait_s == policy.max_wait_s


def test_a_provider_that_is_no_candidate_is_never_preferred() -> None:
    affinity = CacheAffinity(AffinityPolicy())
    a, b = slot("a"), slot("b")
    affinity.placed("m", a, "s1", chain(PROMPT), now=0)
    a.health = "unavailable"
    assert affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1) is None
    a.health = AVAILABLE
    assert affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1, exclude={"a"}) is None


def test_sessions_are_bounded_and_expire() -> None:
    affinity = CacheAffinity(AffinityPolicy(max_sessions=2, session_ttl_s=10))
    a, b = slot("a"), slot("b")
    for name in ("s1", "s2", "s3"):
        affinity.placed("m", a, name, (), now=0)
    assert len(affinity.sessions) == 2
    assert affinity.sessions.get("s1", now=1) is None
    assert affinity.sessions.get("s3", now=1) == "a"
    assert affinity.sessions.get("s3", now=11) is None
    assert affinity.prefer("m", [a, b], "s2", (), now=20) is None


def test_disabled_affinity_prefers_nothing() -> None:
    affinity = CacheAffinity(AffinityPolicy(enabled=False))
    a, b = slot("a"), slot("b")
    affinity.placed("m", a, "s1", chain(PROMPT), now=0)
    assert affinity.prefer("m", [a, b], "s1", chain(PROMPT), now=1) is None
