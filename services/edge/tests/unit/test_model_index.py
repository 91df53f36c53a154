"""The per-model selection index: the same choice as the rule's plain scan, in O(log n)."""

from __future__ import annotations

import random

import pytest

from iop_edge.domain.events import Completed, ErrorCode, Failed
from iop_edge.domain.fleet import PUBLIC_OPERATIONS, Operation
from iop_edge.domain.outliers import OutlierPolicy
from iop_edge.domain.pool import (
    AVAILABLE,
    UNAVAILABLE,
    UNKNOWN,
    ModelIndex,
    ProviderSlot,
    index_models,
    select,
)


def slot(name: str, in_flight: int = 0, capacity: int = 4, health: str = AVAILABLE) -> ProviderSlot:
    s = ProviderSlot(name, "node", capacity=capacity, health=health, connected=True)
    s.own_in_flight = in_flight
    return s


def test_ties_go_to_the_provider_listed_first_in_the_model() -> None:
    first, second = slot("first", 1, 2), slot("second", 2, 4)  # 1/2 == 2/4
    assert ModelIndex("m", [first, second]).select() is first
    assert ModelIndex("n", [second, first]).select() is second


def test_a_lower_ratio_wins_over_more_free_slots() -> None:
    roomy, tight = slot("roomy", 4, 6), slot("tight", 1, 2)
    assert ModelIndex("m", [roomy, tight]).select() is tight


def test_take_and_release_move_a_provider_in_the_order() -> None:
    a, b, c = slot("a", capacity=2), slot("b", capacity=2), slot("c", capacity=4)
    index = ModelIndex("m", [a, b, c])
    chosen = []
    for _ in range(8):
        picked = index.select()
        assert picked is not None
        picked.take()
        chosen.append(picked.provider_id)
    # a (0/2), b (0/2), c (0/4), c (1/4), a (1/2), b (1/2), c (2/4), c (3/4), then full
    assert chosen == ["a", "b", "c", "c", "a", "b", "c", "c"]
    assert index.select() is None
    assert index.any_usable  # full, but still candidates: the request waits
    b.release()
    assert index.select() is b
    c.release()
    c.release()
    assert index.select() is b  # c's 2/4 ties b's 1/2: b is listed first
    c.release()
    assert index.select() is c  # 1/4


def test_a_selected_slot_stays_until_taken() -> None:
    a = slot("a", capacity=1)
    index = ModelIndex("m", [a])
    assert index.select() is a
    assert index.select() is a  # select does not consume
    a.take()
    assert index.select() is None


def test_health_connection_and_capacity_changes_are_followed() -> None:
    a, b = slot("a"), slot("b", in_flight=3)
    index = ModelIndex("m", [a, b])
    assert index.select() is a
    a.update(health=UNAVAILABLE)
    assert index.select() is b
    a.update(health=AVAILABLE, connected=False)
    assert index.select() is b
    a.update(connected=True, capacity=0)
    assert index.select() is b
    b.update(reported_in_flight=4)  # the node reports b full (other edges' runs)
    assert index.select() is None
    assert index.any_usable  # b is usable though full
    b.update(health=UNKNOWN)
    assert not index.any_usable
    a.update(capacity=8)
    assert index.select() is a
    assert index.any_usable


def test_the_reported_count_counts_until_our_own_releases() -> None:
    lagging = slot("p", capacity=2)
    index = ModelIndex("m", [lagging])
    lagging.update(reported_in_flight=2)
    assert index.select() is None
    lagging.take()
    lagging.release()  # lowers both counts: a freed slot is never blocked by a lagging report
    assert lagging.in_flight == 1
    assert index.select() is lagging


def test_a_provider_serving_two_models_is_kept_current_in_both() -> None:
    shared, only_m, only_n = slot("shared"), slot("m1", 1), slot("n1", 1)
    indexes = index_models([("m", [shared, only_m]), ("n", [only_n, shared])], [shared])
    assert shared.model_ids() == ["m", "n"]
    assert indexes["m"].select() is shared
    assert indexes["n"].select() is shared  # 0/4 beats 1/4 though listed second
    shared.take()
    shared.take()
    assert indexes["m"].select() is only_m
    assert indexes["n"].select() is only_n


def test_rebuilding_the_indexes_detaches_slots_from_the_old_ones() -> None:
    a, b = slot("a"), slot("b")
    old = index_models([("m", [a, b])], [a, b])["m"]
    new = index_models([("m", [b, a])], [a, b])["m"]
    assert a.model_ids() == ["m"]
    assert new.select() is b
    b.take()
    assert new.select() is a
    assert old.select() is None  # the old index's entries were all retired


def test_the_heap_stays_bounded_under_churn() -> None:
    slots = [slot(f"p{i}", capacity=8) for i in range(10)]
    index = ModelIndex("m", slots)
    rng = random.Random(3)
    for _ in range(5_000):
        chosen = index.select()
        if chosen is not None:
            chosen.take()
        busy = [s for s in slots if s.own_in_flight]
        rng.choice(busy).release()
        assert len(index._heap) <= 3 * len(slots) + 64


# ------------------------------------------------------------ randomized equivalence


def _random_fleet(
    rng: random.Random, pool: dict[str, ProviderSlot]
) -> list[tuple[str, list[ProviderSlot]]]:
    """A few models over random subsets of the pool, each in its own provider order."""
    names = list(pool)
    models = []
    for m in range(rng.randint(1, 4)):
        members = rng.sample(names, rng.randint(0, len(names)))
        models.append((f"m{m}", [pool[name] for name in members]))
    return models


_EJECT_FAST = OutlierPolicy(consecutive_failures=2, cooldown_s=1.0)
_OUTCOMES = (
    Failed(ErrorCode.PROVIDER_ERROR, "HTTP 500", provider_status=500),
    Failed(ErrorCode.PROVIDER_UNAVAILABLE, "refused"),
    Failed(ErrorCode.CANCELLED, "client gone"),
    Completed(finish_reason="stop"),
    None,
)


def _random_operations(rng: random.Random) -> frozenset[Operation]:
    """Mostly all of them (as most providers), else a random non-empty part."""
    if rng.random() < 0.5:
        return frozenset(Operation)
    return frozenset(rng.sample(list(Operation), rng.randint(1, len(Operation))))


@pytest.mark.parametrize("seed", range(40))
def test_the_index_chooses_what_the_scan_chooses(seed: int) -> None:
    rng = random.Random(seed)
    pool = {
        f"p{i}": ProviderSlot(f"p{i}", f"n{i % 3}", capacity=rng.choice((0, 1, 2, 3, 4, 6, 8)))
        for i in range(rng.randint(1, 12))
    }
    for s in pool.values():
        s.update(connected=rng.random() < 0.8, health=rng.choice((AVAILABLE, AVAILABLE, UNKNOWN)))
        s.offer(_random_operations(rng))
    models = _random_fleet(rng, pool)
    indexes = index_models(models, pool.values())
    slots = list(pool.values())
    ejected = 0
    for step in range(600):
        action = rng.random()
        target = rng.choice(slots)
        if action < 0.35:  # a request: take what the index chose
            model_id, _ = rng.choice(models)
            chosen = indexes[model_id].select()
            if chosen is not None:
                chosen.take()
        elif action < 0.6:
            target.release()
        elif action < 0.7:
            target.take()  # a slot taken beyond its capacity must not break anything
        elif action < 0.8:  # a snapshot
            target.update(
                health=rng.choice((AVAILABLE, AVAILABLE, AVAILABLE, UNAVAILABLE, UNKNOWN)),
                reported_in_flight=rng.randint(0, 9),
            )
        elif action < 0.88:  # a node lost or back
            node = target.node_id
            connected = rng.random() < 0.6
            for s in slots:
                if s.node_id == node:
                    s.update(connected=connected, reported_in_flight=0 if not connected else None)
        elif action < 0.96:
            target.update(capacity=rng.choice((0, 1, 2, 3, 4, 6, 8)))
        elif action < 0.98:  # a new fleet config: other models, other orders, operations
            for s in slots:
                s.offer(_random_operations(rng))
            models = _random_fleet(rng, pool)
            indexes = index_models(models, pool.values())
        elif action < 0.99:  # a provider answered 501 for an operation
            target.refuse(rng.choice(list(Operation)))
        else:  # its node connected again: what it refused is tried again
            target.offer(target.declared)
        if rng.random() < 0.3:  # outlier ejection: a run's end, or a cooldown over
            other = rng.choice(slots)
            if rng.random() < 0.75:
                other.record_outcome(rng.choice(_OUTCOMES), float(step), _EJECT_FAST)
            else:
                ejected += other.end_ejection()
        for model_id, members in models:
            index = indexes[model_id]
            assert index.select() is select(members), (seed, step, model_id)
            assert index.any_usable == any(s.usable for s in members), (seed, step, model_id)
            for op in Operation:  # a request for ``op``: only the members that offer it
                offering = [s for s in members if op in s.operations]
                lacking = index.lacking.get(op, frozenset())
                assert lacking == {s.provider_id for s in members} - {
                    s.provider_id for s in offering
                }, (seed, step, model_id, op)
                assert index.offers(op) == (not members or bool(offering)), (seed, step, op)
                assert index.select(lacking) is select(offering), (seed, step, model_id, op)
    assert ejected, seed  # providers went through ejection and trial


def test_a_request_for_an_operation_goes_only_to_the_members_that_offer_it() -> None:
    chat_only, everything = slot("chat-only"), slot("everything", in_flight=3)
    chat_only.offer(frozenset({Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS}))
    index = ModelIndex("m", [chat_only, everything])
    assert index.lacking == {
        Operation.EMBEDDINGS: {"chat-only"},
        Operation.COUNT_TOKENS: {"chat-only", "everything"},  # no tokenizer type declared
    }
    assert Operation.CHAT_COMPLETIONS not in index.lacking  # the common case: no filter
    assert index.select(index.lacking[Operation.EMBEDDINGS]) is everything  # though 3/4
    assert index.operations == list(PUBLIC_OPERATIONS)
    assert everything.refuse(Operation.EMBEDDINGS)  # it answered 501
    assert not everything.refuse(Operation.EMBEDDINGS)  # once is news, not twice
    assert not index.offers(Operation.EMBEDDINGS)
    assert index.operations == [Operation.CHAT_COMPLETIONS, Operation.COMPLETIONS]
    everything.offer(everything.declared)  # its node connected again
    assert everything.refused == frozenset()
    assert index.offers(Operation.EMBEDDINGS)
