"""Data locality in the scheduler (scheduler/locality.py): an endpoint that holds a task's inputs
is preferred by the transfer time it saves, not forced; tasks without inputs are placed exactly as
before; the pruned search still equals a full scan; bad input pairs are clear errors."""

from __future__ import annotations

import random

import pytest

from scheduler import EndpointState, Scheduler, TaskInfo
from scheduler.locality import check_inputs, moved_bytes, transfer_s

MB = 2**20


def _sched(policy: str = "delta-outage-aware") -> Scheduler:
    s = Scheduler(policy)
    for eid in ("a", "b", "c"):
        s.add_endpoint(EndpointState(eid, workers=2, hardware="pi4"), 0.0)
        s.heartbeat(eid, 0.0, rtt_s=0.02)
    return s


def test_arithmetic() -> None:
    inputs = (("a", 3 * MB), ("b", MB), ("a", MB))
    assert moved_bytes(inputs, "a") == MB and moved_bytes(inputs, "b") == 4 * MB and moved_bytes(inputs, "z") == 5 * MB
    assert transfer_s(inputs, "a", MB) == pytest.approx(1.0)
    assert transfer_s(inputs, "z", 0.0) == float("inf") and transfer_s((), "z", 0.0) == 0.0


@pytest.mark.parametrize("policy", ["delta", "delta-outage-aware"])
@pytest.mark.parametrize("holder", ["a", "b", "c"])
def test_endpoint_holding_the_inputs_wins(policy: str, holder: str) -> None:
    s = _sched(policy)
    s.place([TaskInfo("warm", "f", 100)], 0.5)  # profile f once so no probe decides
    s.task_completed("warm", 0.6, runtime_s=0.01)
    [pl] = s.place([TaskInfo("t1", "f", 100, inputs=((holder, 20 * MB),))], 1.0)
    assert pl.endpoint_id == holder
    task = TaskInfo("t2", "f", 100, inputs=((holder, 20 * MB),))
    pred = {e: s.policy.predictor.estimate(task, s.fleet.nodes[e], 1.0) for e in ("a", "b", "c")}
    others = [p.transfer_in for e, p in pred.items() if e != holder]
    assert pred[holder].transfer_in < min(others) and min(others) - pred[holder].transfer_in == pytest.approx(
        20 * MB / s.fleet.nodes["a"].bw)  # Delta's transfer time of the 20 MiB the others lack


def test_inputs_split_over_endpoints_go_where_most_bytes_are() -> None:
    s = _sched()
    [pl] = s.place([TaskInfo("t1", "f", 0, inputs=(("a", MB), ("c", 30 * MB), ("b", 2 * MB)))], 1.0)
    assert pl.endpoint_id == "c"


def test_locality_is_a_preference_not_a_rule() -> None:
    """A small input on a busy endpoint does not pull work there: its queue costs more."""
    s = _sched("delta")
    s.place([TaskInfo("warm", "f", 0)], 0.1)
    s.task_completed("warm", 0.2, runtime_s=1.0)
    busy = [TaskInfo(f"q{i}", "f", 0) for i in range(6)]
    for t in busy:
        s.assign(t, "b", 0.5)
    [pl] = s.place([TaskInfo("t1", "f", 0, inputs=(("b", 1000),))], 1.0)
    assert pl.endpoint_id != "b"


def test_tasks_without_inputs_are_unaffected() -> None:
    s, s2 = _sched("delta"), _sched("delta")
    a = [p.endpoint_id for p in s.place([TaskInfo(f"t{i}", "f", 100) for i in range(7)], 1.0)]
    b = [p.endpoint_id for p in s2.place([TaskInfo(f"t{i}", "f", 100, inputs=()) for i in range(7)], 1.0)]
    assert a == b


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pruned_search_still_equals_full_scan_with_inputs(seed: int) -> None:
    def run(prune: bool) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        s = Scheduler("delta", prune=prune)
        ids = [f"e{i}" for i in range(40)]
        for eid in ids:
            s.add_endpoint(EndpointState(eid, workers=rng.choice([1, 2, 4]), hardware=rng.choice(["pi4", "hpc"])), 0.0)
            s.heartbeat(eid, 0.0, rtt_s=rng.uniform(0.01, 0.2))
        out = []
        for step in range(30):
            batch = [TaskInfo(f"t{step}-{j}", rng.choice(["f", "g"]), rng.randrange(0, 100_000),
                              inputs=tuple((rng.choice(ids), rng.randrange(0, 2**24)) for _ in range(rng.randrange(0, 4))))
                     for j in range(rng.randrange(1, 8))]
            out += [(p.task_id, p.endpoint_id) for p in s.place(batch, float(step))]
        return out

    assert run(True) == run(False)


def test_bad_inputs_are_clear_errors() -> None:
    assert check_inputs([("a", 1), ["b", 0]]) == (("a", 1), ("b", 0))
    for bad, msg in (([("a",)], "not an \\(endpoint_id, bytes\\) pair"), ([("", 1)], "non-empty string"),
                     ([("a", -1)], "integer >= 0"), ([("a", 1.5)], "integer >= 0"), ([("a", True)], "integer >= 0"),
                     ([("a", 1)] * 1025, "at most 1024")):
        with pytest.raises(ValueError, match=msg):
            check_inputs(bad)


def test_delta_does_not_probe_where_the_inputs_would_have_to_move() -> None:
    """Delta's first task of a function on an unprofiled hardware class is a probe; a task whose
    inputs lie elsewhere is not used as that probe (it would pay the transfer)."""
    s = Scheduler("delta")
    s.add_endpoint(EndpointState("a", workers=2, hardware="pi4"), 0.0)
    s.add_endpoint(EndpointState("b", workers=2, hardware="pi5"), 0.0)
    for eid in ("a", "b"):
        s.heartbeat(eid, 0.0, rtt_s=0.02)
    [pl] = s.place([TaskInfo("t1", "f", 0, inputs=(("b", 50 * MB),))], 1.0)
    assert pl.endpoint_id == "b"
    [pl2] = s.place([TaskInfo("t2", "g", 0, inputs=(("a", 50 * MB),))], 1.0)
    assert pl2.endpoint_id == "a"
