"""The unconfirmed lease ahead to a site follows the gateway's measured confirmation delay."""

from __future__ import annotations

import pytest

from cloud_hub.site_lease import ConfirmClock


def test_starts_at_the_floor_and_grows_with_slow_confirmations() -> None:
    c = ConfirmClock(8.0, 3600.0)
    assert c.lease_s() == 8.0
    c.sent(["a", "b"], now=100.0)
    c.confirmed(["a", "b"], now=112.0)  # 12 s over a congested uplink
    assert c.estimate_s == 12.0 and c.lease_s() == 48.0
    assert c.pending == 0


def test_fast_confirmations_keep_the_floor_and_the_cap_holds() -> None:
    c = ConfirmClock(8.0, 30.0)
    c.sent(["a"], 0.0)
    c.confirmed(["a"], 0.2)
    assert c.lease_s() == 8.0
    c.sent(["b"], 1.0)
    c.confirmed(["b"], 1000.0)
    assert c.lease_s() == 30.0


def test_a_resend_keeps_the_first_send_time_and_unknown_ids_teach_nothing() -> None:
    c = ConfirmClock(1.0, 100.0, alpha=1.0)
    c.sent(["a"], 0.0)
    c.sent(["a"], 9.0)  # the lease expired and the task went out again
    c.confirmed(["a", "zzz"], 10.0)
    assert c.estimate_s == 10.0
    c.confirmed(["zzz", {"not": "an id"}, 7], 50.0)  # a malformed ack teaches nothing and raises nothing
    assert c.estimate_s == 10.0


def test_pending_sends_are_bounded() -> None:
    c = ConfirmClock(1.0, 10.0, max_pending=3)
    c.sent([str(i) for i in range(10)], 0.0)
    assert c.pending == 3


@pytest.mark.parametrize("floor,cap", [(0.0, 1.0), (5.0, 1.0), (-1.0, 3.0)])
def test_bad_bounds_are_refused(floor: float, cap: float) -> None:
    with pytest.raises(ValueError):
        ConfirmClock(floor, cap)
