"""The scheduler's environment cold-start term (scheduler/environments.py): endpoints that hold a
task's environment are preferred, a metered link pays for the bytes, tasks without an
environment are placed exactly as before, and the pruned search still equals a full scan."""

from __future__ import annotations

import random

import pytest

from scheduler import EndpointState, Scheduler, TaskInfo
from scheduler.environments import CONTAINER_PRIOR, PIP_PRIOR, EnvCost, EnvCosts, env_cold_start


def test_cold_start_arithmetic() -> None:
    cost = EnvCost(build_s=4.0, fetch_bytes=10 * 2**20)
    assert env_cold_start(cost, held=True, bandwidth=1e6, metered=True) == 0.0
    assert env_cold_start(None, held=False, bandwidth=1e6, metered=True) == 0.0
    lan = env_cold_start(cost, held=False, bandwidth=2**20, metered=False)
    assert lan == pytest.approx(4.0 + 10.0)
    assert env_cold_start(cost, held=False, bandwidth=2**20, metered=True, metered_s_per_mb=2.0) == pytest.approx(lan + 20.0)


def test_learned_costs_start_from_the_prior_and_move_towards_builds() -> None:
    costs = EnvCosts(alpha=0.5)
    assert costs.get(None) is None and costs.get("e1") == PIP_PRIOR
    assert costs.observe("e1", 10.0, 1000) == EnvCost(10.0, 1000)
    assert costs.observe("e1", 20.0, 3000) == EnvCost(15.0, 2000)
    with pytest.raises(ValueError, match=">= 0"):
        costs.observe("e1", -1.0, 0)
    assert costs.get("e1") == EnvCost(15.0, 2000)  # the bad report changed nothing


def _sched(policy: str, metered_b: bool = False) -> Scheduler:
    s = Scheduler(policy)
    for eid, metered in (("a", False), ("b", metered_b)):
        s.add_endpoint(EndpointState(eid, workers=2, hardware="pi4", metered=metered), 0.0)
        s.heartbeat(eid, 0.0, rtt_s=0.02)
    return s


@pytest.mark.parametrize("policy", ["delta", "warming-aware"])
def test_endpoint_holding_the_environment_wins(policy: str) -> None:
    s = _sched(policy)
    s.fleet.set_envs("b", ["env1"])
    task = TaskInfo("t1", "f", 100, env="env1", env_cost=EnvCost(30.0, 50 * 2**20))
    [pl] = s.place([task], 1.0)
    assert pl.endpoint_id == "b"
    # ...and the other way round: the environment alone decides between two equal endpoints
    s2 = _sched(policy)
    s2.fleet.set_envs("a", ["env1"])
    [pl2] = s2.place([TaskInfo("t1", "f", 100, env="env1", env_cost=EnvCost(30.0, 50 * 2**20))], 1.0)
    assert pl2.endpoint_id == "a"


@pytest.mark.parametrize("policy", ["delta", "warming-aware"])
def test_endpoint_with_the_container_image_staged_wins(policy: str) -> None:
    """An agent reports container specs whose image is staged there among its held environments
    (mesh_agent/engine/environments.py held_specs): that endpoint is charged no pull."""
    from mesh_agent.protocol.environment import env_id, normalize

    sid = env_id(normalize({"container": "/srv/images/fl-rootfs"}))
    for holder in ("a", "b"):
        s = _sched(policy)
        s.fleet.set_envs(holder, [sid])
        task = TaskInfo("t1", "f", 100, env=sid, env_cost=CONTAINER_PRIOR)
        other = "b" if holder == "a" else "a"
        assert s.policy.predictor.estimate(task, s.fleet.nodes[holder], 1.0).cold < \
            s.policy.predictor.estimate(task, s.fleet.nodes[other], 1.0).cold - CONTAINER_PRIOR.build_s + 1e-6
        [pl] = s.place([task], 1.0)
        assert pl.endpoint_id == holder


def test_predicted_cold_start_counts_build_bytes_and_metering() -> None:
    s = _sched("delta", metered_b=True)
    task = TaskInfo("t1", "f", 0, env="env1", env_cost=EnvCost(3.0, 8 * 2**20))
    pa = s.policy.predictor.estimate(task, s.fleet.nodes["a"], 1.0)
    pb = s.policy.predictor.estimate(task, s.fleet.nodes["b"], 1.0)
    assert pa.cold >= 3.0
    assert pb.cold > pa.cold + 8 * 2.0 - 1e-6  # 8 MiB at 2 s per metered MiB
    s.fleet.set_envs("b", ["env1"])
    assert s.policy.predictor.estimate(task, s.fleet.nodes["b"], 1.0).cold < pa.cold


def test_tasks_without_an_environment_are_unaffected() -> None:
    s = _sched("delta")
    s.fleet.set_envs("b", ["env1"])
    plain = TaskInfo("t1", "f", 100)
    assert s.policy.predictor.estimate(plain, s.fleet.nodes["a"], 1.0).cold == s.policy.predictor.estimate(plain, s.fleet.nodes["b"], 1.0).cold


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pruned_search_still_equals_full_scan_with_environments(seed: int) -> None:
    def run(prune: bool) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        s = Scheduler("delta", prune=prune)
        for i in range(40):
            s.add_endpoint(EndpointState(f"e{i}", workers=rng.choice([1, 2, 4]), hardware=rng.choice(["pi4", "hpc"]),
                                         metered=rng.random() < 0.3), 0.0)
            s.heartbeat(f"e{i}", 0.0, rtt_s=rng.uniform(0.01, 0.2))
            s.fleet.set_envs(f"e{i}", [e for e in ("env1", "env2") if rng.random() < 0.3])
        out = []
        for step in range(30):
            batch = [TaskInfo(f"t{step}-{j}", rng.choice(["f", "g"]), rng.randrange(0, 100_000),
                              env=rng.choice([None, "env1", "env2"]), env_cost=EnvCost(rng.uniform(1, 20), rng.randrange(0, 2**24)))
                     for j in range(rng.randrange(1, 8))]
            out += [(p.task_id, p.endpoint_id) for p in s.place(batch, float(step))]
        return out

    assert run(True) == run(False)


def test_delta_does_not_probe_where_the_environment_would_have_to_be_built() -> None:
    """Delta sends a function's first task to an unprofiled hardware class as a probe; a task
    whose environment that class lacks is not used as the probe (it would pay the build)."""
    s = Scheduler("delta")
    s.add_endpoint(EndpointState("a", workers=2, hardware="pi4"), 0.0)
    s.add_endpoint(EndpointState("b", workers=2, hardware="pi5"), 0.0)
    for eid in ("a", "b"):
        s.heartbeat(eid, 0.0, rtt_s=0.02)
    s.fleet.set_envs("a", ["env1"])
    [first] = s.place([TaskInfo("t0", "f", 0)], 0.5)  # no environment: may probe either class
    s.task_completed("t0", 0.6, runtime_s=0.01)
    env_task = TaskInfo("t1", "f", 0, env="env1", env_cost=EnvCost(30.0, 50 * 2**20))
    [pl] = s.place([env_task], 1.0)
    assert pl.endpoint_id == "a" and "probe" not in pl.reason


def test_failures_block_the_function_in_its_environment_only() -> None:
    """A missing module in the agent's own Python blocks the bare function there, not the same
    function in an environment that brings the module; an environment that failed to build
    blocks only that function+environment pair (a changed spec has a new id: placed again)."""
    s = _sched("delta")
    [p0] = s.place([TaskInfo("t0", "f", 0)], 1.0)
    s.task_completed("t0", 1.1, 0.0, ok=False, error="ModuleNotFoundError")
    bad = p0.endpoint_id
    other = "b" if bad == "a" else "a"
    assert {p.endpoint_id for p in s.place([TaskInfo(f"t{i}", "f", 0) for i in range(1, 4)], 2.0)} == {other}
    s.fleet.set_envs(bad, ["env1"])
    [p4] = s.place([TaskInfo("t4", "f", 0, env="env1", env_cost=EnvCost(30.0, 2**20))], 3.0)
    assert p4.endpoint_id == bad  # the environment brings the module: not blocked
    s.task_completed("t4", 3.1, 0.0, ok=False, error="EnvError")  # and then it failed to build there
    [p5] = s.place([TaskInfo("t5", "f", 0, env="env1", env_cost=EnvCost(30.0, 2**20))], 4.0)
    assert p5.endpoint_id == other
    [p6] = s.place([TaskInfo("t6", "f", 0, env="env2", env_cost=EnvCost(1.0, 0))], 5.0)
    assert p6.endpoint_id in ("a", "b")  # a changed spec is placed anywhere again
    assert "f@env1" in s.fleet.nodes[bad].blocked and "f@env2" not in s.fleet.nodes[bad].blocked
