"""The agent's estimate of the hub's clock (regression, found by ``mesh-sim run``: a welcome that
waited 60 s in the broker's queue for the agent's session set its clock 30 s wrong, and from then
on the agent refused every frame of the hub as "from the future" while its link looked fine)."""

from __future__ import annotations

import math

import pytest

from mesh_agent.clock import GOOD_RTT_S, HubClock


def test_a_quick_round_trip_sets_the_offset_within_half_of_it() -> None:
    c = HubClock()
    assert c.offset == 0.0 and c.rtt == math.inf
    # hub 100 s ahead; hello left at 1000, welcome stamped when the hub sent it, arrived at 1000.4
    assert c.sample(1000.0, 1000.4, 1100.3) is False
    assert c.offset == pytest.approx(100.1) and abs(c.offset - 100.0) <= 0.4 / 2


def test_a_welcome_that_waited_in_a_queue_does_not_spoil_a_good_estimate() -> None:
    c = HubClock()
    c.sample(1000.0, 1000.2, 1000.1)  # clocks agree
    # hello at 2000 reached the hub at once (hub_time 2000); its welcome arrived 60 s later
    assert c.sample(2000.0, 2060.0, 2000.0) is True  # measure again
    assert c.offset == pytest.approx(0.0)  # not the -30 s the naive formula gives
    assert c.sample(2061.0, 2061.2, 2061.1) is False  # the new hello's quick answer is taken
    assert c.offset == pytest.approx(0.0)


def test_a_slow_first_sample_is_taken_but_asks_for_another() -> None:
    c = HubClock()  # a Pi after a power cut: no RTC, nothing better to go on
    assert c.sample(0.0, 70.0, 5000.0) is True
    assert c.offset == pytest.approx(4965.0) and c.rtt == 70.0
    assert c.sample(100.0, 150.0, 5080.0) is True  # better than the first: taken, still too slow
    assert c.rtt == 50.0 and c.offset == pytest.approx(4955.0)
    assert c.sample(200.0, 200.0 + GOOD_RTT_S, 5205.0) is False
    assert c.offset == pytest.approx(5000.0)
