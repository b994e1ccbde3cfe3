"""The mixed-fleet FL scenario (issue 11, item 4): its file, the ``fl`` options that compare
client-selection policies (each bad value an error naming it), and the comparison's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.emulate import load_scenario
from sim.emulate.flrun import _time_to, compare, summary
from sim.emulate.scenario import ScenarioError

SCENARIO = Path(__file__).resolve().parents[2] / "sim" / "scenarios" / "fl-mixed-fleet.yaml"


def _mini(**fl: object) -> dict:
    return {"name": "mini", "seed": 1, "duration_s": 60, "agents": [{"name": "a", "count": 3}],
            "workload": {"tasks": 5, "mix": {"echo": 1}}, "fl": {"rounds": 2, **fl}}


def test_the_shipped_scenario_compares_predicted_with_random_on_a_mixed_fleet() -> None:
    for reduced in (False, True):
        sc = load_scenario(SCENARIO, reduced=reduced)
        assert sc.fl is not None and sc.fl.selections == ["predicted", "random"]
        assert sc.fl.clients_per_round is not None and sc.fl.clients_per_round < sc.n_agents
        groups = {g.name: g for g in sc.agents}
        assert groups["slow"].device == "pi-zero-w" and groups["slow"].link.bandwidth_kbps
        assert groups["flaky"].outage is not None and groups["fast"].device is None
    full = load_scenario(SCENARIO)
    assert full.fl.target_accuracy == 0.9 and full.fl.rounds >= 10


@pytest.mark.parametrize("fl, message", [
    ({"selections": ["predicted"]}, "predicted/random selections need clients_per_round"),
    ({"selections": ["random", "random"], "clients_per_round": 2}, "must not repeat"),
    ({"selections": ["fastest"], "clients_per_round": 2}, r"fl\.selections\.0"),
    ({"selections": []}, r"fl\.selections"),
    ({"selections": ["random"], "clients_per_round": 2, "min_clients": 3}, r"min_clients \(3\) cannot exceed clients_per_round \(2\)"),
    ({"clients_per_round": 0}, r"fl\.clients_per_round"),
    ({"target_accuracy": 1.5}, r"fl\.target_accuracy"),
    ({"fairness_rounds": 0}, r"fl\.fairness_rounds"),
])
def test_bad_fl_options_are_errors_that_name_them(fl: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        load_scenario(_mini(**fl))


def test_time_to_target_counts_from_the_first_round_start() -> None:
    stamps = [(12.0, 0.5), (14.0, 0.89), (15.5, 0.91), (17.0, 0.95)]
    assert _time_to(0.9, 10.0, stamps) == (5.5, 3)
    assert _time_to(0.99, 10.0, stamps) == (None, None)  # never reached
    assert _time_to(0.9, None, stamps) == (None, None)  # no round started
    assert _time_to(0.9, 10.0, [(11.0, None), (13.0, 0.9)]) == (3.0, 2)  # a skipped round has no accuracy


def test_comparison_reports_the_speedup_and_whether_the_target_is_met() -> None:
    runs = {"predicted": {"time_to_target_s": 20.0, "target_round": 9, "final_accuracy": 0.93, "rounds_s": 40.0, "rounds_done": 20},
            "random": {"time_to_target_s": 50.0, "target_round": 8, "final_accuracy": 0.94, "rounds_s": 160.0, "rounds_done": 20}}
    c = compare(runs, 0.9)
    assert c["speedup_predicted_over_random"] == 2.5 and c["target_1_5x_met"] is True
    assert c["final_accuracy_diff_points"] == -1.0 and c["mean_round_s"] == {"predicted": 2.0, "random": 8.0}
    runs["random"]["time_to_target_s"] = 25.0
    assert compare(runs, 0.9)["target_1_5x_met"] is False
    runs["predicted"]["time_to_target_s"] = None  # predicted never got there: no speed-up to claim
    c = compare(runs, 0.9)
    assert c["speedup_predicted_over_random"] is None and c["target_1_5x_met"] is False
    line = summary({"runs": runs, "comparison": c})
    assert line.startswith("predicted: ") and "random: " in line
