"""The emulation's site figures and gateway moves (sim/emulate/sites.py), pure parts: which site a
device was in when it finished a task, which tasks finished while that site's uplink was down,
and the scenario checks for moves (bad input: a clear error naming the field)."""

from __future__ import annotations

import pytest

from sim.emulate import build_schedule, load_scenario
from sim.emulate.scenario import ScenarioError
from sim.emulate.sites import compare, site_of_at, tasks_during_outages

SCEN = "sim/scenarios/village.yaml"


def test_site_of_a_device_follows_its_moves() -> None:
    initial = {"a-0": "gwa", "a-1": "gwa"}
    moves = [(100.0, "a-1", "gwa", "gwb")]
    assert site_of_at(initial, moves, "a-1", 99.9) == "gwa"
    assert site_of_at(initial, moves, "a-1", 100.0) == "gwb"
    assert site_of_at(initial, moves, "a-0", 500.0) == "gwa"
    assert site_of_at(initial, moves, "gwa-0", 5.0) is None  # a gateway is no site's device


def test_tasks_during_outages_counts_by_site_and_time() -> None:
    initial = {"a-0": "gwa", "a-1": "gwa", "b-0": "gwb"}
    moves = [(100.0, "a-1", "gwa", "gwb")]
    down = {"gwa": [(10.0, 20.0), (50.0, 60.0)], "gwb": [(95.0, 130.0)]}
    finished = [("a-0", 15.0), ("a-0", 20.0), ("a-0", 55.0), ("a-1", 96.0), ("a-1", 120.0), ("b-0", 5.0),
                ("gwa-0", 15.0)]
    out = tasks_during_outages(finished, initial, moves, down)
    # a-0: 15 and 55 inside gwa's outages (20 is the moment it came back); a-1 at 96 was still at
    # site A (up then), at 120 at site B (down); the gateway's own task is no device's
    assert out == {"gwa": {"done": 4, "during_outage": 2}, "gwb": {"done": 2, "during_outage": 1}}


def test_compare_totals() -> None:
    a = {"total": {"uplink_bytes": 100, "tasks_done_during_uplink_outage": 40, "tasks_done_by_devices": 90}, "sites": {"gwa": {"x": 1}}}
    b = {"total": {"uplink_bytes": 300, "tasks_done_during_uplink_outage": 5, "tasks_done_by_devices": 90}, "sites": {"gwa": {"x": 2}}}
    c = compare(a, b)
    assert c["uplink_bytes"] == {"gateways": 100, "without_gateways": 300, "ratio_without_to_with": 3.0}
    assert c["tasks_done_during_uplink_outage"] == {"gateways": 40, "without_gateways": 5}
    assert c["per_site"]["gwa"] == {"gateways": {"x": 1}, "without_gateways": {"x": 2}}


def test_village_moves_one_device_and_compares() -> None:
    for reduced in (False, True):
        sc = load_scenario(SCEN, reduced=reduced)
        assert sc.compare_without_gateways
        moves = [e for e in build_schedule(sc).events if e.kind == "gateway_move"]
        assert len(moves) == 1 and moves[0].cause == "gwb" and moves[0].target.startswith("farma-")


@pytest.mark.parametrize("move, message", [
    ({"at_s": 5, "agent": "farma-9", "to": "gwb"}, "is not a device behind a gateway"),
    ({"at_s": 5, "agent": "gwa-0", "to": "gwb"}, "is not a device behind a gateway"),
    ({"at_s": 5, "agent": "farma-0", "to": "farmb"}, "is not a gateway group"),
    ({"at_s": -1, "agent": "farma-0", "to": "gwb"}, "at_s"),
])
def test_bad_gateway_moves_are_refused(move: dict, message: str) -> None:
    import yaml

    data = yaml.safe_load(open(SCEN))
    data.pop("reduced")
    data["faults"]["gateway_moves"] = [move]
    with pytest.raises(ScenarioError, match=message):
        load_scenario(data)


def test_compare_without_gateways_needs_a_gateway() -> None:
    import yaml

    data = yaml.safe_load(open("sim/scenarios/flapping.yaml"))
    data.pop("reduced", None)
    data["compare_without_gateways"] = True
    with pytest.raises(ScenarioError, match="needs at least one gateway group"):
        load_scenario(data)
