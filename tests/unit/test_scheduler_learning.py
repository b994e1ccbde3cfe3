"""What used to be a prior is learned (issue 27): cold starts from the worker that ran a call,
a first-wave runtime from the same function elsewhere scaled by measured relative speed, warm
sets merged with what the hub sent, throughput without idle gaps. Mechanisms only: no timing."""

from __future__ import annotations

import pytest

from scheduler import EndpointState, Profiles, Scheduler, TaskInfo, Throughput


def ep(eid: str, workers: int = 1) -> EndpointState:
    return EndpointState(eid, workers=workers, hardware=f"endpoint:{eid}")


def _sched(*eids: str) -> Scheduler:
    s = Scheduler("delta", profiles=Profiles(default_cold_start_s=0.25))
    for e in eids:
        s.add_endpoint(ep(e), 0.0)
    return s


def _run(s: Scheduler, tid: str, f: str, eid: str, now: float, runtime: float, worker: int) -> None:
    s.assign(TaskInfo(tid, f), eid, now)
    s.task_completed(tid, now, runtime, worker=worker)


def test_a_cold_start_is_learned_from_the_first_call_in_each_worker() -> None:
    s = _sched("a")
    p = s.profiles
    assert p.cold_start("f", "a") == pytest.approx(0.25)  # the prior, until measured
    # worker 1: the first call pays 2 s of start-up on top of a 0.3 s body; nothing warm known
    # yet, so its time stands in for the run time until the first warm call
    _run(s, "t1", "f", "a", 1.0, 2.3, worker=1)
    assert p.runtime("f", "a")[0] == pytest.approx(2.3)
    _run(s, "t2", "f", "a", 2.0, 0.3, worker=1)  # warm: replaces the stand-in, yields the cold start
    assert p.runtime("f", "a")[0] == pytest.approx(0.3)
    assert p.cold_start("f", "a") == pytest.approx(2.0)
    for i in range(5):
        _run(s, f"w{i}", "f", "a", 3.0 + i, 0.3, worker=1)
    # a second worker's first call is split against the warm mean right away
    _run(s, "t3", "f", "a", 10.0, 2.5, worker=2)
    assert p.cold_start("f", "a") == pytest.approx(2.1, rel=1e-3)
    assert p.runtime("f", "a")[0] == pytest.approx(0.3)
    # and the prediction for a worker where f is not warm carries it
    s.fleet.set_warm("a", [])
    pl = s.place([TaskInfo("t4", "f")], 11.0)[0]
    assert pl.predicted.cold == pytest.approx(2.1, rel=1e-3)
    assert pl.predicted.run == pytest.approx(0.3)


def test_a_function_that_loads_for_free_learns_a_cold_start_near_zero() -> None:
    s = _sched("a")
    for i in range(4):
        _run(s, f"w{i}", "f", "a", float(i), 0.05, worker=7)
    _run(s, "c", "f", "a", 5.0, 0.05, worker=8)  # a new worker, no extra cost
    assert s.profiles.cold_start("f", "a") == pytest.approx(0.0, abs=1e-9)


def test_a_beat_sent_before_the_worker_loaded_the_function_does_not_mark_it_cold() -> None:
    s = _sched("a")
    s.profiles.observe_cold("f", "a", 3.0, 0.0)
    s.fleet.refresh_cold("f", "a")
    s.place([TaskInfo("t1", "f")], 1.0)  # sent: f is about to be warm there
    s.heartbeat("a", 1.1, warm_functions=[], queued=1, running=0)  # an older view of the agent
    p = s.place([TaskInfo("t2", "f")], 1.2)[0]
    assert p.predicted.cold == 0.0  # merged with what the hub sent, not overwritten
    s.task_completed("t1", 2.0, 0.1)
    s.task_completed("t2", 2.1, 0.1)
    s.heartbeat("a", 3.0, warm_functions=[])  # nothing in flight: the agent's word is final
    p = s.place([TaskInfo("t3", "f")], 3.1)[0]
    assert p.predicted.cold == pytest.approx(3.0)


def test_first_wave_runtime_comes_from_other_endpoints_scaled_by_measured_speed() -> None:
    s = _sched("fast", "slow", "new")
    p = s.profiles
    # g ran everywhere: "slow" takes 4x as long as "fast", "new" 2x
    for i in range(3):
        _run(s, f"gf{i}", "g", "fast", float(i), 1.0, worker=1)
        _run(s, f"gs{i}", "g", "slow", float(i), 4.0, worker=2)
        _run(s, f"gn{i}", "g", "new", float(i), 2.0, worker=3)
    # a new function h: nothing known anywhere -> the prior, scaled by each one's measured speed
    r_fast, src = p.runtime("h", "fast")
    assert src == "prior"
    assert p.runtime("h", "slow")[0] == pytest.approx(4 * r_fast)
    # f ran on "fast" only (0.5 s): on the others it is predicted from that, scaled
    for i in range(3):
        _run(s, f"f{i}", "f", "fast", 10.0 + i, 0.5, worker=1)
    r, src = p.runtime("f", "slow")
    assert src == "function" and r == pytest.approx(2.0)
    assert p.runtime("f", "new")[0] == pytest.approx(1.0)
    # with nothing to compare an endpoint by, the fixed prior
    s.add_endpoint(ep("blank"), 20.0)
    assert p.runtime("q", "blank") == (pytest.approx(1.0), "prior")


def test_throughput_does_not_count_idle_time_between_waves_as_work() -> None:
    tp = Throughput()
    t = 0.0
    for wave in range(5):
        for i in range(20):
            t += 0.1
            tp.observe(t, busy=i < 19)  # the last task of a wave leaves the endpoint idle
        t += 120.0  # idle until the next wave (below the 300 s idle cut-off)
        t += 0.1  # the next wave's first task takes 0.1 s after it arrives
    assert tp.rate == pytest.approx(10.0)


def test_scheduler_feeds_throughput_with_the_backlog_after_each_completion() -> None:
    s = _sched("a")
    t = 0.0
    for wave in range(4):
        s.place([TaskInfo(f"{wave}-{i}", "f") for i in range(10)], t)
        for i in range(10):
            t += 0.2
            s.task_completed(f"{wave}-{i}", t, 0.2)
        t += 200.0
    assert s.profiles.endpoint_rate("a") == pytest.approx(5.0)


def test_calibration_corrects_a_consistent_transfer_error_within_bounds() -> None:
    s = _sched("a", "b")
    t = 0.0
    lag = 0.4  # every result from "a" takes 0.4 s longer than its link predicts (say, hub lag)
    for i in range(40):
        pl = s.place([TaskInfo(f"t{i}", "f", endpoints=frozenset({"a"}))], t)[0]
        pred = pl.predicted  # (its queue term carries the correction once there is one: the real queue is empty)
        start = t + pred.transfer_in
        t = start + pred.run + pred.cold + pred.transfer_out + lag  # the run is as predicted; only the transfer is off
        s.task_completed(f"t{i}", t, pred.run + pred.cold, started_at=start)
        t += 1.0
    rep = s.calibration_report("a")
    assert rep["transfer"]["n"] == 40
    assert rep["run"]["mean_error_s"] == pytest.approx(0.0, abs=1e-6)
    assert rep["transfer"]["mean_error_s"] == pytest.approx(lag, rel=0.05)
    assert rep["applied_bias_s"] == pytest.approx(lag, rel=0.05)
    assert rep["queue"]["mean_error_s"] == pytest.approx(0.0, abs=1e-6)
    assert rep["transfer_out"]["mean_error_s"] == pytest.approx(lag, rel=0.05)
    # the correction is in the prediction (as queue wait), so "a" now loses to an equal "b"
    p = s.place([TaskInfo("x", "f")], t)[0]
    assert p.endpoint_id == "b"
    a_pred = [c for c in p.compared if c.endpoint_id == "a"]
    assert not a_pred or a_pred[0].total > p.predicted.total
    # one wild outlier moves the correction by a bounded step, not to the outlier
    before = rep["applied_bias_s"]
    s.task_completed("x", t + 500.0, 0.0)
    pl = s.place([TaskInfo("y", "f", endpoints=frozenset({"a"}))], t + 501)[0]
    s.task_completed("y", t + 501 + pl.predicted.total + 1000.0, pl.predicted.run)
    assert abs(s.calibration_report("a")["applied_bias_s"] - before) < 0.5
    assert s.calibration_report("a")["applied_bias_s"] <= Scheduler.MAX_BIAS_S


def test_calibration_never_corrects_noise() -> None:
    import random

    rng = random.Random(3)
    s = _sched("a")
    t = 0.0
    for i in range(200):
        pl = s.place([TaskInfo(f"t{i}", "f")], t)[0]
        t += pl.predicted.total + rng.gauss(0.0, 0.05)
        s.task_completed(f"t{i}", t, pl.predicted.run)
        t += 1.0
    assert abs(s.calibration_report("a")["applied_bias_s"]) < 0.03
