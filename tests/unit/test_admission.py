"""Admission control and fair share (cloud_hub/admission.py): pure logic, checked without a hub."""

from __future__ import annotations

import pytest

from cloud_hub.admission import Flow, Limits, check_queue, parse_policy, plan_lease, retry_after_s, too_big

F1 = "a" * 64
F2 = "b" * 64


def test_parse_policy_reads_limits_and_shares() -> None:
    p = parse_policy({"user": {"max_queued": 100, "max_running": 4}, "users": {"alice": {"max_queued": 10}},
                      "functions": {F1: {"max_running": 2}}}, {"alice": 3})
    assert p.user_limits("u_x", "bob") == Limits(100, 4)
    assert p.user_limits("u_y", "alice") == Limits(10, None)
    assert p.function_limits(F1) == Limits(None, 2)
    assert p.function_limits(F2) == Limits()
    assert p.share("u_y", "alice") == 3.0 and p.share("u_x", "bob") == 1.0
    assert p.caps_running


@pytest.mark.parametrize("limits, shares, words", [
    ({"user": {"max_queud": 5}}, None, "unknown key(s) ['max_queud']"),
    ({"user": {"max_queued": 0}}, None, "limits.user.max_queued: must be a whole number >= 1"),
    ({"user": {"max_running": 2.5}}, None, "limits.user.max_running"),
    ({"user": {"max_running": True}}, None, "limits.user.max_running"),
    ({"user": [1]}, None, "limits.user: expected an object"),
    ({"functions": {"myfn": {"max_queued": 3}}}, None, "'myfn' is not a function id"),
    ({"tenants": {}}, None, "limits: unknown key(s) ['tenants']"),
    ({"users": [1, 2]}, None, "limits.users: expected an object"),
    (None, {"alice": 0}, "shares.alice: a share is a number > 0"),
    (None, {"alice": -1}, "shares.alice"),
    (None, {"alice": float("nan")}, "shares.alice"),
    (None, {"alice": "lots"}, "shares.alice"),
    (None, [("alice", 1)], "shares: expected an object"),
])
def test_parse_policy_refuses_bad_config_with_the_entry_named(limits: object, shares: object, words: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_policy(limits, shares)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_queue_bound_refuses_with_retry_after_from_drain_rate() -> None:
    p = parse_policy({"user": {"max_queued": 100}, "functions": {F1: {"max_queued": 10}}})
    assert check_queue(p, "u", "alice", {F2: 50}, 50, {}, 0.0) is None  # exactly at the bound
    r = check_queue(p, "u", "alice", {F2: 51}, 50, {}, 10.0)
    assert r is not None and "over your bound of 100" in r.detail and r.retry_after_s == 1
    r = check_queue(p, "u", "alice", {F2: 90}, 50, {}, 2.0)
    assert r is not None and r.retry_after_s == 20  # 40 over, 2 per second
    r = check_queue(p, "u", "alice", {F1: 5}, 0, {F1: 8}, 0.0)
    assert r is not None and F1 in r.detail and r.retry_after_s == 5  # no drain measured yet: a default
    assert too_big(p, "u", "alice", {F1: 11}) is not None and too_big(p, "u", "alice", {F1: 10}) is None
    assert too_big(p, "u", "alice", {F2: 101}) is not None


def test_retry_after_is_bounded() -> None:
    assert retry_after_s(10**9, 0.001) == 60
    assert retry_after_s(1, 1e9) == 1


def _count(plan: list[tuple[str, str, int]], user: str) -> int:
    return sum(k for u, _, k in plan if u == user)


def test_fair_plan_gives_a_newcomer_slots_before_a_flooder() -> None:
    flows = [Flow("A", F1, 2000, oldest=1.0), Flow("B", F2, 100, oldest=50.0)]
    # A already runs 10 on this endpoint: B gets the next 10 slots, then they alternate.
    plan = plan_lease(14, flows, {"A": 10, "B": 0})
    assert _count(plan, "B") == 12 and _count(plan, "A") == 2
    fifo = plan_lease(14, flows, {"A": 10, "B": 0}, fair=False)
    assert _count(fifo, "A") == 14 and _count(fifo, "B") == 0


def test_fair_plan_follows_shares() -> None:
    flows = [Flow("A", F1, 1000, 1.0), Flow("B", F1, 1000, 2.0)]
    plan = plan_lease(400, flows, {}, weights={"A": 3.0, "B": 1.0})
    assert _count(plan, "A") == 300 and _count(plan, "B") == 100


def test_concurrency_limits_hold_in_both_orders() -> None:
    flows = [Flow("A", F1, 100, 1.0), Flow("A", F2, 100, 2.0), Flow("B", F1, 100, 3.0)]
    for fair in (True, False):
        plan = plan_lease(50, flows, {}, user_room={"A": 7}, function_room={F1: 5}, fair=fair)
        assert _count(plan, "A") <= 7
        assert sum(k for _, f, k in plan if f == F1) <= 5
        assert sum(k for *_, k in plan) == 7 + max(0, 5 - sum(k for u, f, k in plan if u == "A" and f == F1))


def test_a_users_functions_take_turns_and_queues_are_not_overdrawn() -> None:
    plan = plan_lease(10, [Flow("A", F1, 3, 1.0), Flow("A", F2, 100, 2.0)], {})
    assert dict(((f, k) for _, f, k in plan)) == {F1: 3, F2: 7}
    assert plan_lease(10, [], {}) == []
    assert plan_lease(0, [Flow("A", F1, 3, 1.0)], {}) == []


def test_predicted_capacity_is_workers_times_measured_rate() -> None:
    from cloud_hub.console.capacity import predicted_capacity

    rows = predicted_capacity([(F1, "train", 40, 0.25), (F2, "noop", 3, 0.0)], 4, [F1])
    assert rows[0]["per_worker_per_s"] == 4.0 and rows[0]["tasks_per_s"] == 16.0 and rows[0]["warm"]
    assert rows[1]["tasks_per_s"] is None and not rows[1]["warm"]  # no measurable run time: no prediction
    assert predicted_capacity([(F1, "train", 1, 0.5)], None, None)[0]["tasks_per_s"] is None  # workers unknown


def test_a_frame_runs_each_users_share_together_or_in_arrival_order() -> None:
    from cloud_hub.store.fair import frame_order

    picked = {"B": [("b1", 5.0), ("b2", 6.0)], "A": [("a1", 1.0), ("a2", 7.0)]}
    assert [t[0] for t in frame_order(picked, True, lambda t: t[1])] == ["b1", "b2", "a1", "a2"]
    assert [t[0] for t in frame_order(picked, False, lambda t: t[1])] == ["a1", "b1", "b2", "a2"]
