"""The site gateway's re-send timeout (mesh_agent/backoff.py, AckTimeout): pure logic."""

from __future__ import annotations

import pytest

from mesh_agent.backoff import AckTimeout


def test_starts_at_the_floor_and_stays_there_on_a_fast_uplink() -> None:
    t = AckTimeout(floor=10.0)
    assert t.timeout == 10.0
    for _ in range(20):
        t.sample(0.3)
    assert t.timeout == 10.0, "acks in 0.3 s: re-sending after 10 s is already slow enough"


def test_learns_a_slow_uplink_from_its_ack_delays() -> None:
    t = AckTimeout(floor=10.0)
    for d in (30.0, 35.0, 28.0, 40.0, 33.0):
        t.sample(d)
    assert t.srtt is not None and 28.0 < t.srtt < 40.0
    assert t.timeout > 40.0, "no re-send before a typical ack could arrive"
    assert t.timeout == pytest.approx(t.srtt + 4 * t.rttvar)


def test_re_sends_double_the_wait_until_a_fresh_sample_and_never_pass_the_ceiling() -> None:
    t = AckTimeout(floor=10.0, ceiling=300.0)
    t.backoff()
    assert t.timeout == 20.0
    t.backoff()
    assert t.timeout == 40.0
    for _ in range(10):
        t.backoff()
    assert t.timeout == 300.0
    t.sample(1.0)
    assert t.timeout == 10.0, "an ack of a frame sent once resets the backoff"


def test_a_negative_delay_from_a_clock_step_counts_as_zero() -> None:
    t = AckTimeout(floor=5.0)
    t.sample(-3.0)
    assert t.srtt == 0.0 and t.timeout == 5.0
