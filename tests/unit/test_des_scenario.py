"""Scenario files: the shipped ones load; mistakes give errors that say where and what."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.des import ScenarioError, load_scenario, run_scenario

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "sim" / "scenarios").glob("des-*.yaml"))

SMALL = {
    "name": "small",
    "seed": 1,
    "endpoints": [{"hardware": "pi4", "count": 2}, {"hardware": "laptop", "count": 1}],
    "functions": [{"id": "f", "kind": "numeric", "base_s": 2.0}],
    "workload": {"tasks": 10, "arrival": {"kind": "batch", "batch_size": 5}, "mix": {"f": 1.0}},
}


def test_shipped_scenarios_load() -> None:
    names = {p.name for p in SCENARIOS}
    assert {"des-heterogeneous.yaml", "des-bursty.yaml", "des-rural-outages.yaml", "des-scale.yaml"} <= names
    for p in SCENARIOS:
        sc = load_scenario(p)
        assert sc.n_endpoints > 0 and sc.workload.tasks > 0
    scale = load_scenario(SCENARIOS[[p.name for p in SCENARIOS].index("des-scale.yaml")])
    assert scale.n_endpoints == 1000 and scale.workload.tasks == 1_000_000


def _bad(tmp_path: Path, mutate) -> str:
    data = yaml.safe_load(yaml.safe_dump(SMALL))
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    msg = str(exc.value)
    assert str(path) in msg
    return msg


def test_misspelled_field_is_an_error_naming_its_path(tmp_path: Path) -> None:
    def m(d):
        d["endpoints"][0]["outage"] = {"markov": {"mean_upp_s": 10, "mean_down_s": 5}}

    msg = _bad(tmp_path, m)
    assert "endpoints.0.outage.markov.mean_upp_s" in msg and "unknown field" in msg
    assert "endpoints.0.outage.markov.mean_up_s" in msg  # and the required one is missing


def test_invalid_values_are_errors(tmp_path: Path) -> None:
    assert "unknown function 'g'" in _bad(tmp_path, lambda d: d["workload"]["mix"].update(g=1.0))
    assert "hardware 'cray'" in _bad(tmp_path, lambda d: d["endpoints"][0].update(hardware="cray"))
    assert "HH:MM" in _bad(tmp_path, lambda d: d["endpoints"][0].update(
        outage={"scheduled": {"offline_from": "25:00", "offline_to": "06:00"}}))
    assert "workload.tasks" in _bad(tmp_path, lambda d: d["workload"].update(tasks=0))
    assert "unknown policy" in _bad(tmp_path, lambda d: d.update(policies=["fastest"]))
    assert "function kind" in _bad(tmp_path, lambda d: d.update(hardware={"pi4": {"speed": {"gpu": 3}}}))


def test_not_yaml_or_not_a_mapping(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("- just\n- a list\n")
    with pytest.raises(ScenarioError, match="mapping"):
        load_scenario(p)
    p.write_text("a: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(p)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


def test_run_scenario_rejects_unknown_policy() -> None:
    with pytest.raises(ScenarioError, match="unknown policy 'best'"):
        run_scenario(SMALL, ["best"])
