"""The load account of an on-demand provider (docs/ARCHITECTURE.md#warm-aware-scheduling)."""

from __future__ import annotations

from iop_node.adapters.ollama import _unix_ms
from iop_node.domain.model_load import LOAD_SEEN_MS, LoadAccount, LoadedModel, LoadTiming


def test_answers_count_loads_and_their_mean_and_a_warm_answer_counts_none() -> None:
    account = LoadAccount()
    account.answered("x", 2000, now_ms=10)
    account.answered("x", LOAD_SEEN_MS - 1, now_ms=20)  # warm: Ollama still says a few ms
    account.answered("x", 1000, now_ms=30)
    state = account.state()
    assert state.timings == (LoadTiming("x", last_ms=1000, mean_ms=1500, loads=2),)
    assert state.models == (LoadedModel("x", since_ms=10),)


def test_the_engines_list_replaces_the_account_keeping_since() -> None:
    account = LoadAccount()
    account.answered("x", 0, now_ms=10)
    account.listed([("x", 900), ("y", 950)], now_ms=50)
    assert account.state().models == (LoadedModel("x", 10, 900), LoadedModel("y", 50, 950))
    account.listed([("y", 990)], now_ms=60)  # x unloaded after its keep_alive
    assert account.state().models == (LoadedModel("y", 50, 990),)


def test_a_host_holding_one_model_drops_the_other_at_an_answer() -> None:
    account = LoadAccount(max_loaded=1)
    account.answered("x", 1500, now_ms=10)
    account.answered("y", 1500, now_ms=20)
    assert [m.name for m in account.state().models] == ["y"]
    assert account.state().max_loaded == 1


def test_ollamas_expiry_stamps_with_nanoseconds_and_zones() -> None:
    assert _unix_ms("2024-06-04T14:38:31.837530123-07:00") == 1717537111837
    assert _unix_ms("2024-06-04T21:38:31Z") == 1717537111000
    assert _unix_ms("") == 0
    assert _unix_ms("not a time") == 0
    assert _unix_ms(None) == 0
