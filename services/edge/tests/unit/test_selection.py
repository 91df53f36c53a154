"""Selection: lowest load ratio among available providers with a free slot
(docs/ARCHITECTURE.md#selection)."""

from __future__ import annotations

from iop_edge.domain.pool import AVAILABLE, UNAVAILABLE, UNKNOWN, ProviderSlot, select


def slot(
    name: str,
    in_flight: int,
    capacity: int,
    *,
    health: str = AVAILABLE,
    connected: bool = True,
) -> ProviderSlot:
    return ProviderSlot(
        name,
        "node",
        capacity=capacity,
        health=health,
        connected=connected,
        own_in_flight=in_flight,
    )


def test_s04_one_of_three_beats_two_of_three() -> None:
    busy, light = slot("busy", 2, 3), slot("light", 1, 3)
    assert select([busy, light]) is light


def test_a_lower_ratio_wins_over_more_free_slots() -> None:
    # 4/6 leaves two slots free, 1/2 leaves one: the ratio decides, not the room
    roomy, tight = slot("roomy", 4, 6), slot("tight", 1, 2)
    assert select([roomy, tight]) is tight


def test_ties_go_to_the_provider_listed_first() -> None:
    first, second = slot("first", 1, 2), slot("second", 2, 4)
    assert select([first, second]) is first
    assert select([second, first]) is second


def test_unavailable_unknown_and_disconnected_are_excluded() -> None:
    candidates = [
        slot("down", 0, 4, health=UNAVAILABLE),
        slot("unprobed", 0, 4, health=UNKNOWN),
        slot("gone", 0, 4, connected=False),
        slot("ok", 3, 4),
    ]
    assert select(candidates) is candidates[-1]


def test_full_providers_and_zero_capacity_are_not_chosen() -> None:
    assert select([slot("full", 2, 2), slot("none", 0, 0)]) is None


def test_the_nodes_report_counts_until_our_own_releases() -> None:
    lagging = ProviderSlot("p", "n", capacity=2, health=AVAILABLE, connected=True)
    lagging.reported_in_flight = 2  # another edge's runs, or a snapshot not yet updated
    assert select([lagging]) is None
    lagging.own_in_flight = 1
    lagging.release()  # our release lowers both counts: a freed slot is never blocked
    assert lagging.in_flight == 1
    assert select([lagging]) is lagging
