"""Pure logic behind the hub's metrics and alerts: the silence the availability model calls
normal for a device (``Availability.normal_silence``) and the device counters read from a
heartbeat (``cloud_hub.metrics.device_counters``), malformed input included."""

from __future__ import annotations

import pytest

from cloud_hub.metrics import device_counters
from scheduler.availability import Availability

H = 3600.0
DAY = 86400.0


def test_no_history_allows_nothing_extra() -> None:
    a = Availability()
    a.heartbeat(0.0)
    assert a.normal_silence(100.0, 50.0) == 0.0


def test_random_outages_allow_their_p90_once_three_were_seen() -> None:
    a = Availability()
    t = 0.0
    a.heartbeat(t)
    durations = [60.0, 120.0, 600.0, 90.0, 300.0]
    for i, d in enumerate(durations):
        t += 2 * H
        a.mark_offline(t, t)
        a.heartbeat(t + d)
        t += d
        if i == 1:  # two outages: not enough to call anything normal
            assert a.normal_silence(t + 10, t) == 0.0
    # p90 of five durations is the largest here
    assert a.normal_silence(t + 10, t) == pytest.approx(600.0)
    assert a.normal_silence(t + 10, t, quantile=0.5) == pytest.approx(120.0)


def test_a_nightly_sleep_is_normal_until_it_ends() -> None:
    """A device offline 22:00-06:00 every night for four days: silence from 22:00 is allowed
    until 06:00, 8 h; a silence that starts at noon reaches no sleep and gets no allowance."""
    a = Availability()
    a.heartbeat(0.0)
    for day in range(4):
        a.mark_offline(day * DAY + 22 * H, day * DAY + 22 * H)
        a.heartbeat((day + 1) * DAY + 6 * H)
    last = 4 * DAY + 22 * H
    assert a.normal_silence(last + 60, last) == pytest.approx(8 * H)
    noon = 4 * DAY + 12 * H
    assert a.normal_silence(noon + 60, noon) == 0.0
    # the same noon silence, still going at 23:00, reached the sleep: allowed to its end
    assert a.normal_silence(4 * DAY + 23 * H, noon) == pytest.approx(18 * H)


def test_device_counters_in_base_units() -> None:
    got = device_counters({"rs": 2, "df": 1024, "tx": 3, "sk": -250, "stored": 4, "outbox": 1, "cpu": 5})
    assert got == {"worker_restarts": 2.0, "disk_free_bytes": 2.0**30, "bytes_sent": 3072.0, "clock_skew_seconds": -0.25,
                   "queue_tasks": 5.0}


@pytest.mark.parametrize("info", [
    {},
    {"rs": "2", "df": None, "tx": [1], "sk": {"a": 1}},
    {"rs": True, "stored": False, "outbox": "3"},
])
def test_malformed_counters_are_dropped_not_raised(info: dict) -> None:
    assert device_counters(info) == {}
