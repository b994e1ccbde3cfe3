"""The unconfirmed lease ahead to a site follows the gateway's measured confirmation delay."""

from __future__ import annotations

import pytest

from cloud_hub.site_lease import MIN_WINDOW_BYTES, ConfirmClock, PendingBatches


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


# --- PendingBatches: cumulative confirmation, holes, the floor (docs/sites.md, "Leases confirmed cumulatively")

def test_stored_up_to_settles_every_batch_up_to_it_once() -> None:
    p = PendingBatches()
    p.sent(1, ["a", "b"], 100, now=0.0)
    p.sent(2, ["c"], 50, now=1.0)
    p.sent(3, ["d"], 70, now=2.0)
    assert p.inflight_bytes == 220 and p.floor(4) == 1
    ids, samples = p.upto(2, now=3.0)
    assert sorted(ids) == ["a", "b", "c"] and samples == [(100, 3.0), (150, 2.0)]
    assert p.upto(2, now=4.0) == ([], []) and p.inflight_bytes == 70 and p.floor(4) == 3
    assert p.ids() == ["d"]


def test_an_empty_batch_is_not_pending_and_the_floor_follows_the_next_seq() -> None:
    p = PendingBatches()
    p.sent(1, [], 80, now=0.0)
    assert len(p) == 0 and p.floor(2) == 2 and p.inflight_bytes == 0


def test_id_confirmations_settle_a_batch_when_its_last_task_is_confirmed() -> None:
    p = PendingBatches()
    p.sent(5, ["a", "b"], 100, now=0.0)
    assert p.confirmed(["a", "zz", 7], now=1.0) == [] and len(p) == 1  # unknown ids and junk teach nothing
    assert p.confirmed(["b"], now=2.0) == [(100, 2.0)] and len(p) == 0 and p.inflight_bytes == 0


def test_a_stepped_over_batch_is_given_up_only_after_the_grace() -> None:
    p = PendingBatches()
    p.sent(1, ["lost"], 100, now=0.0)
    p.sent(2, ["late"], 100, now=0.5)
    p.sent(3, ["x"], 100, now=1.0)
    p.confirmed(["x"], now=1.5)  # batch 3 arrived out of order: 1 and 2 were lost, or are late
    assert p.holes(now=1.6, grace_s=5.0) == []  # a confirmation of theirs may still be on its way
    assert p.holes(now=5.2, grace_s=5.0) == ["lost"]  # older than the grace: given up
    assert p.holes(now=6.0, grace_s=5.0) == ["late"] and len(p) == 0


def test_nothing_is_a_hole_below_no_confirmation() -> None:
    p = PendingBatches()
    p.sent(1, ["a"], 10, now=0.0)
    p.sent(2, ["b"], 10, now=0.0)
    assert p.holes(now=1e6, grace_s=1.0) == []  # slow, not lost: no later batch was confirmed


def test_past_gives_up_what_lies_after_the_hellos_stored_up_to() -> None:
    p = PendingBatches()
    for n in range(1, 6):
        p.sent(n, [f"t{n}"], 10, now=0.0)
    p.upto(2, now=1.0)
    assert sorted(p.past(3)) == ["t4", "t5"] and p.ids() == ["t3"] and p.give_up(3) == ["t3"] and p.give_up(3) == []


def test_pending_batches_are_bounded() -> None:
    p = PendingBatches(max_batches=3)
    for n in range(1, 11):
        p.sent(n, [f"t{n}"], 10, now=0.0)
    assert len(p) == 3 and p.floor(11) == 8 and p.inflight_bytes == 30 and sorted(p.ids()) == ["t10", "t8", "t9"]


def test_the_window_follows_measured_throughput_in_bytes() -> None:
    c = ConfirmClock(8.0, 3600.0)
    assert c.window_bytes() == 4 * MIN_WINDOW_BYTES  # nothing measured yet
    c.batch_confirmed(64_000, 2.0)  # 32 KB/s: a 256 kbit/s uplink
    assert c.window_bytes(target_s=4.0) == 128_000
    assert c.estimate_s == 2.0 and c.lease_s() == 8.0  # the same sample teaches the confirmation delay
    for _ in range(30):
        c.batch_confirmed(100, 10.0)  # a crawling link: never below one small batch
    assert c.window_bytes() == MIN_WINDOW_BYTES
    assert c.lease_s() > 39.0  # ten-second confirmations: an unconfirmed lease of about 40 s
    c.batch_confirmed(0, 1.0)
    c.batch_confirmed(10, 0.0)  # nothing learned about throughput from empty or instant samples
    c.batch_confirmed(10**9, -1.0)  # nor anything from a clock that went backwards
    assert c.window_bytes() == MIN_WINDOW_BYTES


def test_forget_hands_back_every_pending_task_and_resets_the_window() -> None:
    p = PendingBatches()
    p.sent(3, ["a", "b"], 100, now=0.0)
    p.sent(4, ["c"], 50, now=0.0)
    assert sorted(p.forget()) == ["a", "b", "c"] and len(p) == 0 and p.inflight_bytes == 0 and p.floor(5) == 5


def test_a_summary_that_stops_short_frees_a_lost_last_batch() -> None:
    """No later batch shows the hole when the lost batch was the last one: the gateway's summary
    ("stored up to n", in every full summary) does, once the batch is older than the grace."""
    p = PendingBatches()
    p.sent(1, ["a"], 10, now=0.0)
    p.sent(2, ["b"], 10, now=0.0)
    p.upto(1, now=1.0)
    assert p.not_stored(1, now=2.0, grace_s=5.0) == []  # may still be on its way
    assert p.not_stored(1, now=6.0, grace_s=5.0) == ["b"] and len(p) == 0
