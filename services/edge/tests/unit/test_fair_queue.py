"""The model queue's order: classes (interactive by priority, then batch), keys taking
turns by weight within a class, FIFO within a key (domain/queue.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_edge.domain.queue import ModelQueue, Share


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    made = asyncio.new_event_loop()
    yield made
    made.close()


def drain(queue: ModelQueue[str], names: dict[asyncio.Future[str], str]) -> list[str]:
    order = []
    while (waiter := queue.pop_waiting()) is not None:
        order.append(names[waiter])
    return order


def fill(
    loop: asyncio.AbstractEventLoop,
    queue: ModelQueue[str],
    pushes: list[tuple[str, Share, bool]],
) -> dict[asyncio.Future[str], str]:
    names: dict[asyncio.Future[str], str] = {}
    for name, share, batch in pushes:
        waiter: asyncio.Future[str] = loop.create_future()
        names[waiter] = name
        queue.push(waiter, batch=batch, share=share)
    return names


A, B, C = Share("a"), Share("b"), Share("c")


def test_a_key_behind_a_burst_waits_one_turn_per_key_waiting(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue: ModelQueue[str] = ModelQueue("m")
    pushes = [(f"a{n}", A, False) for n in range(200)] + [("b0", B, False)]
    names = fill(loop, queue, pushes)
    order = drain(queue, names)
    assert order.index("b0") == 1  # behind the head of the burst only: one turn of a
    assert [n for n in order if n.startswith("a")] == [f"a{n}" for n in range(200)]  # FIFO


def test_a_key_arriving_while_the_burst_is_served_waits_one_turn_per_key(
    loop: asyncio.AbstractEventLoop,
) -> None:
    queue: ModelQueue[str] = ModelQueue("m")
    names = fill(loop, queue, [(f"a{n}", A, False) for n in range(50)])
    served = [names[w] for w in (queue.pop_waiting() for _ in range(10)) if w is not None]
    names |= fill(loop, queue, [("c0", C, False), ("b0", B, False)])
    order = served + drain(queue, names)
    assert order.index("c0") <= 11  # one turn of a at most
    assert order.index("b0") <= 12  # one of a and one of c at most


def test_weights_share_turns_while_both_keys_wait(loop: asyncio.AbstractEventLoop) -> None:
    queue: ModelQueue[str] = ModelQueue("m")
    heavy, light = Share("a", weight=3), Share("b", weight=1)
    pushes = [(f"a{n}", heavy, False) for n in range(300)]
    pushes += [(f"b{n}", light, False) for n in range(100)]
    order = drain(queue, fill(loop, queue, pushes))
    first = Counter(name[0] for name in order[:200])
    assert first == {"a": 150, "b": 50}  # 3:1 while both wait


def test_priority_classes_then_batch_last(loop: asyncio.AbstractEventLoop) -> None:
    queue: ModelQueue[str] = ModelQueue("m")
    pushes = [
        ("batch", Share("a", priority=9), True),
        ("low", Share("a", priority=-1), False),
        ("plain", A, False),
        ("high", Share("b", priority=5), False),
    ]
    assert drain(queue, fill(loop, queue, pushes)) == ["high", "plain", "low", "batch"]


def test_counts_removal_and_iteration_in_service_order(loop: asyncio.AbstractEventLoop) -> None:
    queue: ModelQueue[str] = ModelQueue("m")
    pushes = [("a0", A, False), ("a1", A, False), ("b0", B, False), ("x", A, True)]
    names = fill(loop, queue, pushes)
    assert (len(queue), queue.interactive, queue.batch) == (4, 3, 1)
    assert [names[w] for w in queue] == ["a0", "b0", "a1", "x"]
    queue.remove(next(w for w, n in names.items() if n == "b0"))
    assert [names[w] for w in queue] == ["a0", "a1", "x"]
    assert queue.pop_waiting(batch=False) is not None
    assert queue.pop_waiting(batch=False) is not None
    assert queue.pop_waiting(batch=False) is None  # only the batch line is left
    assert (len(queue), queue.batch) == (1, 1)


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 4), st.integers(-1, 1), st.booleans()),
        max_size=60,
    )
)
def test_every_waiter_comes_out_once_in_its_keys_order(
    pushes: list[tuple[str, int, int, bool]],
) -> None:
    loop = asyncio.new_event_loop()
    try:
        queue: ModelQueue[str] = ModelQueue("m")
        spec = [
            (f"{key}{n}", Share(key, weight, priority), batch)
            for n, (key, weight, priority, batch) in enumerate(pushes)
        ]
        names = fill(loop, queue, spec)
        listed = [names[w] for w in queue]
        order = drain(queue, names)
        assert order == listed  # iteration is the service order
        assert sorted(order) == sorted(names.values())
        ranks = {name: (batch, -share.priority) for name, share, batch in spec}
        assert [ranks[n] for n in order] == sorted(ranks[n] for n in order)
        for key in "abc":  # FIFO within a key and class
            for rank in set(ranks.values()):
                mine = [n for n in order if n[0] == key and ranks[n] == rank]
                assert mine == sorted(mine, key=lambda n: int(n[1:]))
    finally:
        loop.close()
