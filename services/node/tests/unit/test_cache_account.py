"""CacheAccount: the prompts a provider's engine served, newest first, bounded, and its
prompt tokens cached."""

from __future__ import annotations

import pytest

from iop_node.domain.cache_account import CacheAccount, CacheView
from iop_proto.prefix import BLOCK_CHARS, body_blocks


def chat(*contents: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": text} for text in contents]}


def test_a_new_account_holds_nothing_and_knows_no_rate() -> None:
    assert CacheAccount(4).view == CacheView((), 0, 0, None)


def test_prompts_are_kept_newest_first_as_tail_and_length() -> None:
    account = CacheAccount(4)
    first, second = [1, 2, 3], [7, 8]
    account.served(first)
    account.served(second)
    assert account.view.prefixes == ((8, 2), (3, 3))


def test_the_oldest_prompt_leaves_past_the_limit() -> None:
    account = CacheAccount(3)
    for n in range(1, 6):
        account.served([100 * n, 100 * n + 1])
    assert account.view.prefixes == ((501, 2), (401, 2), (301, 2))


def test_a_prompt_served_again_moves_to_the_front_once() -> None:
    account = CacheAccount(4)
    account.served([1, 2])
    account.served([5, 6])
    account.served([1, 2])
    assert account.view.prefixes == ((2, 2), (6, 2))


def test_a_longer_prompt_replaces_the_one_it_extends() -> None:
    """An agent's next turn: the engine holds the longer prompt, which the shorter starts."""
    account = CacheAccount(4)
    account.served([1, 2])
    account.served([9])
    account.served([1, 2, 3, 4])
    assert account.view.prefixes == ((4, 4), (9, 1))


def test_a_shorter_prompt_keeps_the_longer_one_it_starts() -> None:
    """A retry of an earlier turn: the longer prompt may well still be cached too."""
    account = CacheAccount(4)
    account.served([1, 2, 3])
    account.served([1, 2])
    assert account.view.prefixes == ((2, 2), (3, 3))


def test_a_prompt_that_branches_off_keeps_the_other_branch() -> None:
    account = CacheAccount(4)
    account.served([1, 2, 3])
    account.served([1, 2, 4])
    assert account.view.prefixes == ((4, 3), (3, 3))


def test_real_bodies_of_one_conversation_take_one_place() -> None:
    system = "s" * (3 * BLOCK_CHARS)
    turn_one = body_blocks(chat(system, "first question " * 40))
    turn_two = body_blocks(chat(system, "first question " * 40, "an answer " * 60))
    assert turn_two[: len(turn_one)] == turn_one  # the premise: the second extends the first
    account = CacheAccount(4)
    account.served(turn_one)
    account.served(turn_two)
    assert account.view.prefixes == ((turn_two[-1], len(turn_two)),)


def test_a_prompt_without_a_whole_block_is_counted_not_kept() -> None:
    account = CacheAccount(4)
    account.served(body_blocks(chat("short")), prompt_tokens=12, cached_tokens=4)
    assert account.view == CacheView((), 12, 4, None)


def test_a_limit_of_zero_keeps_no_prompt_but_counts_tokens() -> None:
    account = CacheAccount(0)
    account.served([1, 2], prompt_tokens=10, cached_tokens=6)
    assert account.view == CacheView((), 10, 6, None)


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        CacheAccount(-1)


def test_token_totals_add_up_and_cached_never_passes_prompt() -> None:
    account = CacheAccount(4)
    account.served([1], prompt_tokens=500, cached_tokens=0)
    account.served([2], prompt_tokens=510, cached_tokens=490)
    account.served([3], prompt_tokens=5, cached_tokens=9)  # an engine that over-reports
    view = account.view
    assert (view.prompt_tokens, view.cached_tokens) == (1015, 495)


def test_the_prefill_rate_is_weighted_by_the_tokens_evaluated() -> None:
    account = CacheAccount(4)
    account.served([1], prompt_tokens=1000, cached_tokens=0, prefill_ms_per_token=2.0)
    # a cache hit evaluates 10 tokens, slowly per token: it barely moves the rate
    account.served([2], prompt_tokens=1010, cached_tokens=1000, prefill_ms_per_token=12.0)
    rate = account.view.prefill_ms_per_token
    assert rate is not None
    expected = (2.0 * 1000 * 0.8 + 12.0 * 10) / (1000 * 0.8 + 10)
    assert rate == pytest.approx(expected)
    assert 2.0 < rate < 2.2


def test_the_prefill_rate_follows_the_recent_answers() -> None:
    account = CacheAccount(4)
    account.served([1], prompt_tokens=100, prefill_ms_per_token=10.0)
    for n in range(30):
        account.served([n + 2], prompt_tokens=100, prefill_ms_per_token=1.0)
    rate = account.view.prefill_ms_per_token
    assert rate == pytest.approx(1.0, abs=0.01)


def test_an_answer_without_timings_leaves_the_rate_as_it_was() -> None:
    account = CacheAccount(4)
    account.served([1], prompt_tokens=100, prefill_ms_per_token=3.0)
    account.served([2], prompt_tokens=100)
    assert account.view.prefill_ms_per_token == pytest.approx(3.0)


def test_forget_drops_the_prompts_and_keeps_the_totals() -> None:
    account = CacheAccount(4)
    account.served([1, 2], prompt_tokens=300, cached_tokens=100, prefill_ms_per_token=4.0)
    account.forget()
    assert account.view == CacheView((), 300, 100, pytest.approx(4.0))
    account.served([5], prompt_tokens=1)
    assert account.view.prefixes == ((5, 1),)


def test_a_view_does_not_change_with_the_account() -> None:
    account = CacheAccount(4)
    account.served([1])
    view = account.view
    account.served([2])
    account.forget()
    assert view.prefixes == ((1, 1),)
