"""Policies on hand-built fleets: what each one chooses, and why."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from scheduler import (
    POLICIES,
    Constraints,
    EndpointState,
    NoEligibleEndpoint,
    Scheduler,
    TaskInfo,
    make_policy,
)

DAY = 86400.0


def ep(eid: str, hw: str, workers: int = 1, speed: float = 1.0, **kw) -> EndpointState:
    return EndpointState(eid, workers=workers, hardware=hw, speed=speed, **kw)


def teach(s: Scheduler, f: str, runtimes: dict[str, float], now: float, n: int = 3, cold: float = 0.0) -> None:
    """Feed completions as if ``f`` had run ``n`` times on each endpoint."""
    for e, r in runtimes.items():
        for i in range(n):
            s.task_completed(f"learn-{f}-{e}-{i}-{now}", now, r, endpoint_id=e, function_id=f,
                             cold_start_s=cold if i == 0 else 0.0)


def test_four_times_faster_endpoint_gets_the_work_once_profiled() -> None:
    s = Scheduler("delta")
    s.add_endpoint(ep("slow", "pi4"), 0.0)
    s.add_endpoint(ep("fast", "x86"), 0.0)
    now, chosen = 0.0, []
    for i in range(12):  # one at a time, each completes before the next is placed
        pl = s.place([TaskInfo(f"t{i}", "f")], now)[0]
        run = 4.0 if pl.endpoint_id == "slow" else 1.0
        now += run + 0.2
        s.task_completed(pl.task_id, now, run)
        chosen.append((pl.endpoint_id, pl.exploration))
    # the first tasks probe each hardware group (Delta's rule), then the fast one wins
    assert {e for e, _ in chosen[:2]} == {"slow", "fast"}
    assert all(e == "fast" and not expl for e, expl in chosen[3:])


def test_batch_is_spread_by_earliest_finish_in_proportion_to_speed() -> None:
    s = Scheduler("delta")
    for e, hw in (("s1", "a"), ("s2", "b"), ("s4", "c")):
        s.add_endpoint(ep(e, hw), 0.0)
    teach(s, "f", {"s1": 8.0, "s2": 4.0, "s4": 2.0}, 0.0)
    pls = s.place([TaskInfo(f"t{i}", "f") for i in range(70)], 1.0)
    counts = Counter(p.endpoint_id for p in pls)
    assert counts["s1"] == pytest.approx(10, abs=1)
    assert counts["s2"] == pytest.approx(20, abs=1)
    assert counts["s4"] == pytest.approx(40, abs=1)
    # predicted finish times grow with the batch: list scheduling, not 70 independent picks
    s4 = [p.predicted.total for p in pls if p.endpoint_id == "s4"]
    assert s4 == sorted(s4) and s4[-1] > 30 * 2.0


def test_fastest_endpoint_piles_everything_on_one_endpoint() -> None:
    s = Scheduler("fastest-endpoint")
    for e, hw in (("s1", "a"), ("s2", "b"), ("s4", "c")):
        s.add_endpoint(ep(e, hw), 0.0)
    teach(s, "f", {"s1": 8.0, "s2": 4.0, "s4": 2.0}, 0.0)
    pls = s.place([TaskInfo(f"t{i}", "f") for i in range(70)], 1.0)
    assert {p.endpoint_id for p in pls} == {"s4"}


def _warm_vs_cold(f: str, warm_run: float, cold_run: float) -> str:
    s = Scheduler("delta")
    s.add_endpoint(ep("warm", "pi5", warm_functions=frozenset({f})), 0.0)
    s.add_endpoint(ep("cold", "x86"), 0.0)
    teach(s, f, {"warm": warm_run, "cold": cold_run}, 0.0, cold=5.0)
    s.heartbeat("warm", 1.0, warm_functions={f})
    s.heartbeat("cold", 1.0, warm_functions=set())  # e.g. its workers were recycled
    return s.place([TaskInfo("t", f)], 2.0)[0].endpoint_id


def test_warm_endpoint_beats_a_faster_cold_one_for_a_short_function_only() -> None:
    assert _warm_vs_cold("short", warm_run=1.0, cold_run=0.5) == "warm"  # 1.0 < 0.5 + 5 s cold
    assert _warm_vs_cold("long", warm_run=100.0, cold_run=50.0) == "cold"  # 100 > 50 + 5


def test_warming_aware_prefers_a_warm_endpoint_with_a_free_worker() -> None:
    s = Scheduler("warming-aware")
    s.add_endpoint(ep("a", "x", workers=2), 0.0)
    s.add_endpoint(ep("b", "x", workers=2, warm_functions=frozenset({"f"})), 0.0)
    pls = s.place([TaskInfo(f"t{i}", "f") for i in range(3)], 0.0)
    assert [p.endpoint_id for p in pls] == ["b", "b", "a"]  # b warm until its workers are busy


def test_constraints_are_never_violated_and_impossible_ones_fail_clearly() -> None:
    s = Scheduler("delta")
    s.add_endpoint(ep("cpu", "x86", speed=50.0, memory_mb=64000), 0.0)
    s.add_endpoint(ep("gpu", "gpu-node", gpu=True, memory_mb=8000, tags=frozenset({"cuda"})), 0.0)
    s.add_endpoint(ep("pi", "pi4", memory_mb=4096, tags=frozenset({"field-data"})), 0.0)
    want_gpu = Constraints(gpu=True)
    pls = s.place([TaskInfo(f"g{i}", "f", constraints=want_gpu) for i in range(5)], 0.0)
    assert {p.endpoint_id for p in pls} == {"gpu"}
    pls = s.place([TaskInfo(f"m{i}", "f", constraints=Constraints(min_memory_mb=6000)) for i in range(5)], 0.0)
    assert {p.endpoint_id for p in pls} <= {"cpu", "gpu"}
    pls = s.place([TaskInfo(f"d{i}", "f", constraints=Constraints(frozenset({"field-data"}))) for i in range(3)], 0.0)
    assert {p.endpoint_id for p in pls} == {"pi"}
    with pytest.raises(NoEligibleEndpoint, match=r"gpu memory>=16000MB.*all 3 endpoints"):
        s.place([TaskInfo("x", "f", constraints=Constraints(gpu=True, min_memory_mb=16000))], 0.0)
    for name in POLICIES:  # every policy respects constraints
        s2 = Scheduler(name)
        for e in ("cpu", "gpu", "pi"):
            s2.add_endpoint(ep(e, e, gpu=e == "gpu", memory_mb=8000), 0.0)
        assert {p.endpoint_id for p in s2.place([TaskInfo(f"t{i}", "f", constraints=want_gpu) for i in range(6)], 0.0)} == {"gpu"}


def test_outage_aware_skips_a_dead_endpoint_that_plain_delta_still_uses() -> None:
    for policy, expect_dead_used in (("delta", True), ("delta-outage-aware", False)):
        s = Scheduler(policy)
        s.add_endpoint(ep("fast", "x86"), 0.0)
        s.add_endpoint(ep("ok", "pi4"), 0.0)
        teach(s, "f", {"fast": 1.0, "ok": 3.0}, 1.0)
        s.endpoint_offline("fast", 100.0, since=20.0)  # watchdog: silent for 80 s
        assert not s.fleet["fast"].online
        pl = s.place([TaskInfo("t", "f")], 100.0)[0]
        assert (pl.endpoint_id == "fast") is expect_dead_used


def test_outage_aware_falls_back_when_every_endpoint_is_dead() -> None:
    s = Scheduler("delta-outage-aware")
    s.add_endpoint(ep("a", "x"), 0.0)
    s.endpoint_offline("a", 100.0, since=20.0)
    assert s.place([TaskInfo("t", "f")], 100.0)[0].endpoint_id == "a"  # it waits there


def _nightly(s: Scheduler, eid: str, days: int = 3) -> None:
    for d in range(days):
        s.endpoint_offline(eid, d * DAY + 22 * 3600 + 75, since=d * DAY + 22 * 3600)
        s.heartbeat(eid, (d + 1) * DAY + 6 * 3600)


def test_outage_aware_avoids_an_endpoint_that_sleeps_before_the_task_would_finish() -> None:
    choices = {}
    for policy in ("delta", "delta-outage-aware"):
        s = Scheduler(policy)
        s.add_endpoint(ep("solar", "pi5"), 6 * 3600.0)  # faster, but off 22:00-06:00
        s.add_endpoint(ep("mains", "pi4"), 6 * 3600.0)
        _nightly(s, "solar")
        s.heartbeat("mains", 3 * DAY)
        teach(s, "train", {"solar": 3600.0, "mains": 5400.0}, 3 * DAY + 6 * 3600.0)
        morning = 3 * DAY + 9 * 3600.0
        evening = 3 * DAY + 21 * 3600.0
        m = s.place([TaskInfo("m", "train")], morning)[0].endpoint_id
        s.task_completed("m", morning + 3600, 3600.0)
        e = s.place([TaskInfo("e", "train")], evening)[0].endpoint_id
        choices[policy] = (m, e)
        if policy == "delta-outage-aware":
            pred = s.decision("e").placement.compared
            assert any(p.endpoint_id == "solar" and p.outage > 3600 for p in pred)
    assert choices["delta"] == ("solar", "solar")
    assert choices["delta-outage-aware"] == ("solar", "mains")


def test_outage_aware_prefers_a_stable_endpoint_for_long_tasks_over_a_flappy_one() -> None:
    s = Scheduler("delta-outage-aware")
    s.add_endpoint(ep("flappy", "pi5"), 0.0)
    s.add_endpoint(ep("stable", "pi4"), 0.0)
    t = 0.0
    for _ in range(40):  # down 15 min every hour
        s.endpoint_offline("flappy", t + 3600 + 75, since=t + 3600)
        t += 4500
        s.heartbeat("flappy", t)
    s.heartbeat("stable", t)
    teach(s, "short", {"flappy": 10.0, "stable": 14.0}, t)
    teach(s, "long", {"flappy": 3000.0, "stable": 3600.0}, t)
    assert s.place([TaskInfo("a", "short")], t + 1)[0].endpoint_id == "flappy"
    assert s.place([TaskInfo("b", "long")], t + 1)[0].endpoint_id == "stable"


def test_each_hardware_group_is_probed_once_for_a_new_function() -> None:
    s = Scheduler("delta")
    for i, hw in enumerate(["a", "a", "b", "c", "c"]):
        s.add_endpoint(ep(f"e{i}", hw, speed=1.0 + i), 0.0)
    pls = s.place([TaskInfo(f"t{i}", "new") for i in range(3)], 0.0)
    assert sorted(s.fleet[p.endpoint_id].hardware for p in pls) == ["a", "b", "c"]
    assert all(p.exploration and p.reason.startswith("probe") for p in pls)


def test_placement_explains_itself_and_the_decision_gets_the_actual_time() -> None:
    s = Scheduler("delta")
    s.add_endpoint(ep("a", "x", workers=2), 0.0)
    s.add_endpoint(ep("b", "y", workers=2), 0.0)
    s.add_endpoint(ep("c", "z", workers=2), 0.0)
    teach(s, "f", {"a": 2.0, "b": 3.0, "c": 9.0}, 0.0)
    pl = s.place([TaskInfo("t1", "f", payload_bytes=10_000)], 10.0)[0]
    assert pl.endpoint_id == "a" and pl.reason == "smallest predicted completion"
    p = pl.predicted
    assert p.total == pytest.approx(p.transfer_in + p.queue + p.cold + p.run + p.transfer_out + p.outage)
    assert p.run == pytest.approx(2.0) and p.source == "group"
    compared = pl.compared
    assert compared[0].endpoint_id == "a" and [c.total for c in compared] == sorted(c.total for c in compared)
    assert {c.endpoint_id for c in compared} <= {"a", "b", "c"}
    json.dumps(pl.to_dict())
    dec = s.task_completed("t1", 12.5, 2.1)
    assert dec is not None and dec.actual_s == pytest.approx(2.5) and dec.runtime_s == 2.1
    assert dec.error_s == pytest.approx(2.5 - p.total)
    assert s.decisions(1)[0] is dec
    json.dumps(dec.to_dict())
    assert s.prediction_error()["completed"] == 1


def test_baseline_policies() -> None:
    def fleet(policy: str, **kw) -> Scheduler:
        s = Scheduler(policy, **kw)
        for i in range(4):
            s.add_endpoint(ep(f"e{i}", "x", workers=2), 0.0)
        return s

    tasks = [TaskInfo(f"t{i}", "f") for i in range(8)]
    rr = fleet("round-robin").place(tasks, 0.0)
    assert [p.endpoint_id for p in rr] == ["e0", "e1", "e2", "e3"] * 2
    ll = fleet("least-loaded")
    ll.place([TaskInfo("x", "f"), TaskInfo("y", "f")], 0.0)
    assert ll.place([TaskInfo("z", "f")], 0.0)[0].endpoint_id == "e2"
    r1 = [p.endpoint_id for p in fleet("random", seed=3).place(tasks, 0.0)]
    r2 = [p.endpoint_id for p in fleet("random", seed=3).place(tasks, 0.0)]
    assert r1 == r2 and len(set(r1)) > 1  # seeded: reproducible
    for name in POLICIES:  # every policy records a prediction for predicted-vs-actual
        assert all(p.predicted is not None and p.policy == name for p in fleet(name).place(tasks, 0.0))
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def test_missing_module_blocks_the_function_on_that_endpoint() -> None:
    s = Scheduler("delta")
    s.add_endpoint(ep("a", "x", speed=10.0), 0.0)
    s.add_endpoint(ep("b", "y"), 0.0)
    teach(s, "f", {"a": 1.0, "b": 5.0}, 0.0)
    pl = s.place([TaskInfo("t", "f")], 1.0)[0]
    assert pl.endpoint_id == "a"
    s.task_completed("t", 2.0, 0.1, ok=False, error="ModuleNotFoundError")
    assert {p.endpoint_id for p in s.place([TaskInfo(f"u{i}", "f") for i in range(5)], 3.0)} == {"b"}
    assert s.place([TaskInfo("g", "other")], 3.0)  # other functions still go anywhere


def test_watchdog_sweep_declares_silent_endpoints_dead() -> None:
    s = Scheduler("delta", dead_after_s=75.0)
    s.add_endpoint(ep("a", "x"), 0.0)
    s.add_endpoint(ep("b", "x"), 0.0)
    s.heartbeat("a", 60.0)
    assert s.sweep(100.0) == ["b"]
    assert not s.fleet["b"].online and s.fleet["a"].online
    assert s.heartbeat("b", 130.0) is True  # back
    assert s.profiles.availability("b").mean_outage() == pytest.approx(130.0)


def test_requeued_task_leaves_the_endpoint_queue() -> None:
    s = Scheduler("delta")
    s.add_endpoint(ep("a", "x"), 0.0)
    s.place([TaskInfo(f"t{i}", "f") for i in range(3)], 0.0)
    node = s.fleet.node("a")
    assert node.n_out == 3 and node.wait > 0
    for i in range(3):
        s.task_requeued(f"t{i}", 1.0)
    assert node.n_out == 0 and node.wait == 0.0 and s.in_flight == 0


def test_backlog_reported_by_heartbeat_counts_as_queue() -> None:
    s = Scheduler("delta")
    s.add_endpoint(ep("busy", "x", workers=4), 0.0)
    s.add_endpoint(ep("idle", "y", workers=4), 0.0)
    teach(s, "f", {"busy": 1.0, "idle": 1.5}, 0.0)
    assert s.place([TaskInfo("a", "f")], 1.0)[0].endpoint_id == "busy"
    s.task_completed("a", 2.0, 1.0)
    # another client's tasks, which this scheduler did not place, keep "busy" busy
    s.heartbeat("busy", 3.0, queued=20, running=4)
    pl = s.place([TaskInfo("b", "f")], 3.0)[0]
    assert pl.endpoint_id == "idle"
    assert s.fleet.node("busy").wait > 1.0


def test_retract_undoes_a_batch_including_its_probes() -> None:
    """A batch the hub refuses after placing it (a later task had no eligible endpoint, or the
    database write failed) must leave no trace: no ledger entries, no probes in flight."""
    s = Scheduler("delta")
    s.add_endpoint(ep("a", "pi4"), 0.0)
    s.add_endpoint(ep("b", "pi5"), 0.0)
    bad = TaskInfo("t-bad", "f", constraints=Constraints(gpu=True))
    with pytest.raises(NoEligibleEndpoint):
        s.place([TaskInfo("t0", "f"), TaskInfo("t1", "f"), bad], 0.0)
    assert len(s.fleet.ledger) == 2  # the two before the failure are in the ledger ...
    s.retract(["t0", "t1", "t-bad"])
    assert s.fleet.ledger == {} and s.in_flight == 0  # ... and gone after retract
    assert s.policy.probes == {}
    # so the next batch probes both hardware groups again
    pls = s.place([TaskInfo("u0", "f"), TaskInfo("u1", "f")], 1.0)
    assert {p.endpoint_id for p in pls} == {"a", "b"} and all(p.reason.startswith("probe") for p in pls)
    s.retract(["u0"])
    assert list(s.fleet.ledger) == ["u1"] and s.in_flight == 1


def test_an_explicit_endpoint_list_limits_every_placement() -> None:
    s = Scheduler("delta-outage-aware")
    for e, hw in (("a", "x"), ("b", "y"), ("c", "z")):
        s.add_endpoint(ep(e, hw, tags=frozenset({"farm"}) if e != "c" else frozenset()), 0.0)
    teach(s, "f", {"a": 8.0, "b": 4.0, "c": 1.0}, 0.0)
    pls = s.place([TaskInfo(f"t{i}", "f", endpoints=frozenset({"a", "b"})) for i in range(30)], 1.0)
    assert {p.endpoint_id for p in pls} == {"a", "b"}  # c, the fastest, is not in the list
    assert all({c.endpoint_id for c in p.compared} <= {"a", "b"} for p in pls)
    with pytest.raises(NoEligibleEndpoint, match="rule out the 1 listed endpoints"):
        s.place([TaskInfo("x", "f", constraints=Constraints(frozenset({"farm"})), endpoints=frozenset({"c"}))], 2.0)
