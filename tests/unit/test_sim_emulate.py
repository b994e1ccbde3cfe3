"""The emulation mode's pure parts: scenario validation, the seeded fault schedule, the workload
plan, the shared outage models and the invariant checker (which must be able to fail)."""

from __future__ import annotations

import base64
import random
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mesh_agent.protocol import serialize
from sim.cli import app
from sim.emulate import build_schedule, load_scenario, plan_workload
from sim.emulate.checker import Records, check, percentiles, reconnect_delays
from sim.emulate.functions import CATALOG, expected
from sim.emulate.scenario import ScenarioError
from sim.emulate.workload import payload_of
from sim.outages import MarkovOutage, down_intervals, down_time, markov, union

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"
SHIPPED = ["rural-outages", "power-cuts", "broker-restart", "hub-restart", "flapping"]


def _mini(**over: object) -> dict:
    sc: dict = {"name": "mini", "seed": 1, "duration_s": 60, "agents": [{"name": "a", "count": 3}],
                "workload": {"tasks": 50, "mix": {"echo": 1}}}
    sc.update(over)
    return sc


# ---------------------------------------------------------------- scenarios
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scenarios_and_their_reduced_variants_load(name: str) -> None:
    full = load_scenario(SCENARIOS / f"{name}.yaml")
    small = load_scenario(SCENARIOS / f"{name}.yaml", reduced=True)
    assert full.name == small.name == name
    assert small.n_agents < full.n_agents and small.workload.tasks < full.workload.tasks
    assert small.duration_s < full.duration_s


def test_rural_outages_is_the_size_the_issue_asks_for() -> None:
    sc = load_scenario(SCENARIOS / "rural-outages.yaml")
    assert sc.n_agents == 20 and sc.workload.tasks >= 10_000
    assert {g.transport for g in sc.agents} == {"mqtt", "zmq"}
    assert build_schedule(sc).outage_share() >= 0.3


def test_a_wrong_field_is_an_error_that_names_it() -> None:
    bad = _mini(agents=[{"name": "a", "count": 1, "link": {"latency_ms": 5, "jiter_ms": 1}}])
    with pytest.raises(ScenarioError, match=r"agents\.0\.link\.jiter_ms: unknown field"):
        load_scenario(bad)


@pytest.mark.parametrize("over, message", [
    ({"workload": {"tasks": 5, "mix": {"echo": 1, "nope": 1}}}, "unknown function 'nope'"),
    ({"agents": [{"name": "a", "count": 1, "region": "hill"}]}, "region 'hill' is not a region"),
    ({"agents": [{"name": "A b", "count": 1}]}, "names are"),
    ({"agents": [{"name": "a", "count": 1, "transport": "carrier-pigeon"}]}, "transport"),
    ({"faults": {"agent_kills": {"mean_interval_s": 1, "groups": ["ghost"]}}}, "unknown group 'ghost'"),
    ({"faults": {"hub_restarts": {"at_s": [-1]}}}, "restart times must be >= 0"),
    ({"agents": [{"name": "a", "count": 1, "outage": {"scheduled": {"offline_from": "25:00", "offline_to": "07:00"}}}]}, "HH:MM"),
])
def test_invalid_scenarios_are_refused_with_the_reason(over: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        load_scenario(_mini(**over))


def test_reduced_overrides_merge_by_name_and_refuse_unknown_names() -> None:
    sc = _mini(agents=[{"name": "a", "count": 5}, {"name": "b", "count": 4, "transport": "zmq"}],
               reduced={"agents_per_group": 2, "agents": {"b": {"count": 1}}, "workload": {"tasks": 7}})
    small = load_scenario(sc, reduced=True)
    assert [(g.name, g.count, g.transport) for g in small.agents] == [("a", 2, "mqtt"), ("b", 1, "zmq")]
    assert small.workload.tasks == 7 and small.workload.mix == {"echo": 1}
    with pytest.raises(ScenarioError, match="no item named 'c'"):
        load_scenario({**sc, "reduced": {"agents": {"c": {"count": 1}}}}, reduced=True)
    with pytest.raises(ScenarioError, match="no 'reduced' variant"):
        load_scenario(_mini(), reduced=True)


def test_a_des_scenario_is_pointed_to_mesh_sim_des() -> None:
    with pytest.raises(ScenarioError, match="mesh-sim des"):
        load_scenario(SCENARIOS / "des-bursty.yaml")


def test_cli_run_refuses_a_bad_scenario_with_exit_code_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nduration_s: 10\nagents: [{name: a, count: 1, wokers: 2}]\nworkload: {tasks: 1, mix: {echo: 1}}\n")
    res = CliRunner().invoke(app, ["run", str(bad)])
    assert res.exit_code == 2
    assert "wokers" in res.output and "unknown field" in res.output
    res = CliRunner().invoke(app, ["run", str(SCENARIOS / "des-bursty.yaml")])
    assert res.exit_code == 2 and "mesh-sim des" in res.output


# ---------------------------------------------------------------- fault schedule
def test_the_schedule_is_reproducible_from_the_seed() -> None:
    sc = load_scenario(SCENARIOS / "rural-outages.yaml")
    a, b = build_schedule(sc), build_schedule(sc)
    assert a.events == b.events and a.digest() == b.digest()
    other = build_schedule(sc.model_copy(update={"seed": sc.seed + 1}))
    assert other.digest() != a.digest()
    assert [e.t for e in a.events] == sorted(e.t for e in a.events)


def test_link_outages_pair_up_and_regions_fail_together() -> None:
    sc = load_scenario(SCENARIOS / "rural-outages.yaml")
    s = build_schedule(sc)
    valley = [a.name for a in s.agents if a.region == "valley"]
    assert len(valley) == 12
    region_downs = {a: [e.t for e in s.events if e.target == a and e.cause == "region:valley:markov" and e.kind == "link_down"] for a in valley}
    assert len({tuple(v) for v in region_downs.values()}) == 1 and region_downs[valley[0]]
    for a in s.agents:  # per cause: down, up, down, up, ... (the last may stay down to the end)
        per_cause: dict[str, list[str]] = {}
        for e in s.events:
            if e.target == a.name and e.kind.startswith("link"):
                per_cause.setdefault(e.cause, []).append(e.kind)
        for kinds in per_cause.values():
            assert kinds == ["link_down", "link_up"] * (len(kinds) // 2) + ["link_down"] * (len(kinds) % 2)
    modes = Counter(e.mode for e in s.events if e.kind == "link_down" and e.target.startswith("valley") and e.cause == "markov")
    assert set(modes) == {"reset", "blackhole"}  # cut: mixed


def test_scheduled_outages_follow_the_time_scaled_day() -> None:
    sc = load_scenario(_mini(duration_s=200, clock={"day_s": 120, "start": "12:00"},
                             agents=[{"name": "sun", "count": 1, "outage": {"scheduled": {"offline_from": "19:00", "offline_to": "07:00"}}}]))
    spans = build_schedule(sc).link_down("sun-0")
    # 19:00 is 7 h after the 12:00 start: 7/24 of a 120 s day = 35 s; 07:00 the next day is 95 s.
    assert spans == [(pytest.approx(35.0), pytest.approx(95.0)), (pytest.approx(155.0), 200.0)]


def test_power_cuts_never_hit_a_dead_agent_and_restarts_do_not_overlap() -> None:
    sc = load_scenario(SCENARIOS / "power-cuts.yaml")
    s = build_schedule(sc)
    dead: dict[str, bool] = {}
    for e in s.events:
        if e.kind == "agent_kill":
            assert not dead.get(e.target), f"{e.target} killed while dead"
            dead[e.target] = True
        elif e.kind == "agent_start":
            dead[e.target] = False
    assert s.count("agent_kill") >= 30
    hub = load_scenario(SCENARIOS / "hub-restart.yaml")
    ev = [e for e in build_schedule(hub).events if e.target == "hub"]
    assert [e.kind for e in ev] == ["hub_stop", "hub_start"] * (len(ev) // 2)
    assert {e.mode for e in ev if e.kind == "hub_stop"} == {"term", "kill"}  # signal: mixed


# ---------------------------------------------------------------- workload
def test_the_workload_plan_is_seeded_sorted_and_follows_the_mix() -> None:
    sc = load_scenario(_mini(duration_s=100, workload={"tasks": 4000, "mix": {"echo": 3, "sleep": 1}, "payload_bytes": [10, 1000]}))
    p1, p2 = plan_workload(sc, 3), plan_workload(sc, 3)
    assert p1 == p2
    assert [t.t for t in p1] == sorted(t.t for t in p1) and 0 <= p1[0].t and p1[-1].t < 100
    share = Counter(t.fn for t in p1)["echo"] / len(p1)
    assert 0.7 < share < 0.8
    assert all(10 <= t.size <= 1000 for t in p1) and {t.agent for t in p1} == {0, 1, 2}
    assert payload_of(1, 5, 100) == payload_of(1, 5, 100) != payload_of(2, 5, 100)


def test_the_functions_compute_what_the_checker_expects(tmp_path: Path) -> None:
    log = str(tmp_path / "runs.log")
    pay = payload_of(0, 1, 300)
    for name, param in (("echo", 0.0), ("sleep", 1.0), ("cpu", 1234.0)):
        assert CATALOG[name]("1.0", pay, param, log) == expected(name, "1.0", pay, param)
    with pytest.raises(ValueError) as err:
        CATALOG["fail"]("1.0", pay, 0.0, log)
    assert str(err.value) == expected("fail", "1.0", pay, 0.0)
    assert Path(log).read_text().split() [::2] == ["1.0"] * 4


# ---------------------------------------------------------------- shared outage models
def test_outage_helpers() -> None:
    assert down_intervals(iter([(1, True), (3, False), (5, True), (9, False)]), 7) == [(1, 3), (5, 7)]
    assert union([(5, 7), (1, 3), (2, 4), (7, 8)]) == [(1, 4), (5, 8)]
    assert down_time([(1, 3), (2, 5), (8, 20)], 0, 10) == 6
    spans = down_intervals(markov(MarkovOutage(mean_up_s=30, mean_down_s=10), 0.0, random.Random(7)), 200_000)
    assert 0.23 < down_time(spans, 0, 200_000) / 200_000 < 0.27  # long-run share down/(up+down)


# ---------------------------------------------------------------- checker
def _row(t: float, ok: bool, value: object) -> tuple[float, bool, str]:
    return (t, ok, base64.b64encode(serialize(value)).decode())


def test_the_checker_finds_lost_duplicated_wrong_and_unexpected_results() -> None:
    sc = load_scenario(_mini(workload={"tasks": 6, "mix": {"echo": 1}}))
    plan = plan_workload(sc, 3)
    r = Records(sc.seed, plan)
    for p in plan:
        r.accepted[p.seq] = (f"t{p.seq}", f"{p.seq}.0", 0.0)
        r.hub_tasks[f"t{p.seq}"] = ("ep", "done", 1)
        r.runs[f"{p.seq}.0"] += 1

    def good(seq: int) -> object:
        p = plan[seq]
        return expected(p.fn, f"{seq}.0", payload_of(sc.seed, seq, p.size), p.param)

    for seq in range(6):
        r.deliveries[f"t{seq}"] = [_row(1.0, True, good(seq))]
        r.hub_results[f"t{seq}"] = (1, True, serialize(good(seq)))
    assert check(r)["invariants"]["ok"] is True
    del r.deliveries["t1"], r.hub_results["t1"]  # lost
    r.deliveries["t2"].append(r.deliveries["t2"][0])  # delivered twice
    r.deliveries["t3"] = [_row(1.0, True, good(4))]  # another task's result
    r.hub_results["t3"] = (1, True, serialize(good(4)))
    err = {"type": "mesh_agent.engine.WorkerDied", "message": "x", "traceback": "", "exception": None}
    r.deliveries["t5"] = [_row(1.0, False, err)]
    r.hub_results["t5"] = (1, False, serialize(err))
    r.runs["4.0"] += 2
    out = check(r)
    inv = out["invariants"]
    assert inv["ok"] is False
    assert (inv["lost"], inv["duplicated_sdk"], inv["wrong_results"]) == (1, 1, 1)
    assert inv["unexpected_errors"] == {"mesh_agent.engine.WorkerDied": 1}
    assert out["executions"]["re_executions"] == 2 and out["executions"]["tasks_re_executed"] == 1


def test_reconnect_delays_and_percentiles() -> None:
    tasks = [(0.0, 10.0, "a"), (5.0, 6.0, "a"), (0.0, 3.0, "b"), (12.0, 13.0, "a")]
    dis = {"a": [(2.0, 4.0), (4.5, 8.0)]}
    shared = {"b": [(1.0, 2.0)]}
    assert reconnect_delays(tasks, dis, shared) == [2.0, 1.0]  # a: 10-8; b: 3-2; the rest untouched
    assert percentiles([]) == {"count": 0, "p50": None, "p99": None, "max": None}
    assert percentiles([1.0, 2.0, 3.0])["p50"] == 2.0
