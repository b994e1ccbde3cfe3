"""Pure report helpers of the swarm harness."""

from __future__ import annotations

import pytest

from sim.swarm.stats import check_delivery, per_endpoint_kb, percentile, rate, split_evenly, sum_status


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 0) == 5.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_rate_and_per_endpoint() -> None:
    assert rate(10, 0) == 0.0 and rate(10, 2) == 5.0
    assert per_endpoint_kb(3 * 1024 * 100, 1024 * 100, 100) == 2.0
    assert per_endpoint_kb(1, 0, 0) is None


def test_split_evenly_keeps_every_item_once() -> None:
    parts = split_evenly(list(range(10)), 3)
    assert [len(p) for p in parts] == [4, 3, 3] and sum(parts, []) == list(range(10))
    assert split_evenly([1], 4) == [[1]]
    with pytest.raises(ValueError):
        split_evenly([1], 0)


def test_sum_status_totals_workers() -> None:
    tot = sum_status([{"online": 3, "frames_out": 10}, {"online": 2, "rss": 5}])
    assert tot["online"] == 5 and tot["frames_out"] == 10 and tot["rss"] == 5 and tot["tasks"] == 0


def test_check_delivery_finds_lost_duplicated_and_unknown() -> None:
    assert check_delivery(["a", "b"], ["a", "b"]) == {"submitted": 2, "delivered": 2, "lost": 0, "duplicated": 0, "unknown": 0}
    assert check_delivery(["a", "b", "c"], ["a", "a", "x"]) == {"submitted": 3, "delivered": 1, "lost": 2, "duplicated": 1, "unknown": 1}
