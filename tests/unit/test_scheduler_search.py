"""The pruned earliest-finish search must choose exactly what a full scan chooses."""

from __future__ import annotations

import random

import pytest

from scheduler import Constraints, EndpointState, Scheduler, TaskInfo

HARDWARE = [("hpc", 16, 20.0), ("laptop", 8, 12.0), ("pi5", 4, 7.0), ("pi4", 4, 3.0), ("zero", 1, 1.0)]
FUNCS = ["f-num", "f-io", "f-train"]


def _fleet(rng: random.Random, n: int) -> list[EndpointState]:
    eps = []
    for i in range(n):
        hw, workers, speed = HARDWARE[rng.randrange(len(HARDWARE))]
        tags = frozenset({"sensor"}) if rng.random() < 0.3 else frozenset()
        eps.append(EndpointState(f"e{i}", workers=workers, hardware=hw, speed=speed, tags=tags,
                                 memory_mb=rng.choice([512, 4096, 16384])))
    return eps


def _run(prune: bool, seed: int, policy: str, lists: bool = False) -> list[tuple[str, str]]:
    """Drive one scheduler through a random but reproducible history; return its choices."""
    rng = random.Random(seed)
    sched = Scheduler(policy, prune=prune)
    eps = _fleet(rng, 60)
    now = 0.0
    for ep in eps:
        sched.add_endpoint(ep, now)
        sched.heartbeat(ep.endpoint_id, now, rtt_s=rng.uniform(0.01, 0.2))
        sched.message_timing(ep.endpoint_id, 65536, rng.uniform(0.01, 0.5), now)
    speed_of = {ep.endpoint_id: ep.speed * (0.5 if rng.random() < 0.1 else 1.0) * (1.4 if rng.random() < 0.05 else 1.0)
                for ep in eps}
    inflight: list[tuple[str, str, str]] = []
    choices = []
    lists_of: dict[str, frozenset[str] | None] = {}
    tid = 0
    for step in range(120):
        now += rng.uniform(0.1, 3.0)
        # a batch of mixed tasks, some with constraints
        batch = []
        for _ in range(rng.randrange(1, 12)):
            f = rng.choice(FUNCS)
            c = Constraints(frozenset({"sensor"})) if rng.random() < 0.2 else Constraints(min_memory_mb=rng.choice([0, 0, 1024]))
            ids = None
            if lists and rng.random() < 0.3:  # a user's explicit list of endpoints
                c = Constraints()
                ids = frozenset(e.endpoint_id for e in rng.sample(eps, rng.randrange(1, 12)))
            batch.append(TaskInfo(f"t{tid}", f, rng.randrange(0, 3_000_000), c, endpoints=ids))
            lists_of[f"t{tid}"] = ids
            tid += 1
        for pl in sched.place(batch, now):
            allowed = lists_of[pl.task_id]
            assert allowed is None or pl.endpoint_id in allowed
            choices.append((pl.task_id, pl.endpoint_id))
            inflight.append((pl.task_id, pl.endpoint_id, pl.function_id))
        # complete a random subset, with cold starts and warm-set reports sometimes
        rng.shuffle(inflight)
        keep = []
        for t, e, f in inflight:
            if rng.random() < 0.5:
                base = {"f-num": 20.0, "f-io": 3.0, "f-train": 60.0}[f]
                cold = rng.uniform(1, 5) if rng.random() < 0.2 else 0.0
                warm = frozenset(rng.sample(FUNCS, rng.randrange(0, 3))) if rng.random() < 0.1 else None
                sched.task_completed(t, now, base / speed_of[e] * rng.lognormvariate(0, 0.2),
                                     cold_start_s=cold, result_bytes=rng.randrange(0, 200_000),
                                     warm_functions=warm)
            else:
                keep.append((t, e, f))
        inflight = keep
        # liveness changes
        if rng.random() < 0.2:
            e = rng.choice(eps).endpoint_id
            if sched.fleet[e].online:
                sched.endpoint_offline(e, now, since=now - 80)
            else:
                sched.heartbeat(e, now)
    return choices


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("policy", ["delta", "delta-outage-aware"])
def test_pruned_search_equals_full_scan(seed: int, policy: str) -> None:
    pruned = _run(True, seed, policy)
    full = _run(False, seed, policy)
    assert len(pruned) == len(full) > 500
    assert pruned == full


@pytest.mark.parametrize("policy", ["delta", "delta-outage-aware"])
def test_explicit_endpoint_lists_keep_the_search_exact(policy: str) -> None:
    """A third of the tasks name a random list of endpoints (``TaskInfo.endpoints``): every
    choice is in its list, and pruning still chooses what a full scan chooses."""
    pruned = _run(True, 4, policy, lists=True)
    assert pruned == _run(False, 4, policy, lists=True)


@pytest.mark.parametrize("policy", ["random", "round-robin", "least-loaded", "warming-aware", "fastest-endpoint"])
def test_every_policy_respects_explicit_endpoint_lists(policy: str) -> None:
    sched = Scheduler(policy)
    rng = random.Random(4)
    eps = _fleet(rng, 30)
    for ep in eps:
        sched.add_endpoint(ep, 0.0)
    for i in range(300):
        ids = frozenset(e.endpoint_id for e in rng.sample(eps, rng.randrange(1, 6)))
        pl = sched.place([TaskInfo(f"t{i}", rng.choice(FUNCS), 1000, endpoints=ids)], float(i))[0]
        assert pl.endpoint_id in ids
        if i % 3 == 0:
            sched.task_completed(pl.task_id, i + 0.5, 1.0)


def test_pruning_actually_prunes() -> None:
    rng = random.Random(9)
    sched = Scheduler("delta")
    for ep in _fleet(rng, 300):
        sched.add_endpoint(ep, 0.0)
    for i, f in enumerate(FUNCS * 10):  # profile every group first
        for pl in sched.place([TaskInfo(f"w{i}", f, 1000)], 0.0):
            sched.task_completed(pl.task_id, 1.0, 1.0)
    pls = sched.place([TaskInfo(f"t{i}", "f-num", 1000) for i in range(50)], 2.0)
    assert sum(p.pruned for p in pls) > 50 * 200  # most of the 300 endpoints never evaluated


@pytest.mark.parametrize("aware", [False, True])
def test_search_agrees_with_brute_force_estimates(aware: bool) -> None:
    """The search's arithmetic against ``Predictor.estimate`` (an independent code path) on
    every eligible endpoint, at many points of a random history."""
    rng = random.Random(11)
    sched = Scheduler("delta-outage-aware" if aware else "delta")
    eps = _fleet(rng, 40)
    for e in eps:
        sched.add_endpoint(e, 0.0)
        sched.message_timing(e.endpoint_id, 65536, rng.uniform(0.01, 0.5), 0.0)
    pred = sched.policy.predictor
    fleet = sched.fleet
    now, tid, checked = 0.0, 0, 0
    inflight: list[str] = []
    for _ in range(60):
        now += rng.uniform(0.5, 5)
        batch = [TaskInfo(f"t{tid + i}", rng.choice(FUNCS), rng.randrange(0, 2_000_000)) for i in range(6)]
        tid += 6
        for task in batch:
            groups = fleet.groups_for(task.constraints)
            res = pred.search(task, groups, now, outage_aware=aware, skip_offline=aware)
            cands = [n for n in fleet.nodes.values() if not aware or n.ep.online] or list(fleet.nodes.values())
            brute = min(cands, key=lambda n: (pred.estimate(task, n, now, outage_aware=aware).total, n.idx))
            if res.node is not None:
                assert res.node is brute
                assert res.total == pytest.approx(pred.estimate(task, brute, now, outage_aware=aware).total, rel=1e-12)
                checked += 1
        for pl in sched.place(batch, now):
            inflight.append(pl.task_id)
        rng.shuffle(inflight)
        for t in inflight[: len(inflight) // 2]:
            sched.task_completed(t, now, rng.uniform(0.5, 30), cold_start_s=rng.choice([0.0, 0.0, 3.0]),
                                 warm_functions=frozenset(rng.sample(FUNCS, 1)) if rng.random() < 0.2 else None)
        inflight = inflight[len(inflight) // 2:]
        if rng.random() < 0.3:
            e = rng.choice(eps).endpoint_id
            if fleet[e].online:
                sched.endpoint_offline(e, now, since=now - 80)
            else:
                sched.heartbeat(e, now)
    assert checked > 300
