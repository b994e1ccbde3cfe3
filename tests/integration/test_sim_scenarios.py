"""Every shipped emulation scenario, in its reduced variant, against real processes: Mosquitto,
the hub process, agent processes behind fault-injecting proxies. Each must end with every
accepted task delivered exactly once, and must really have injected the faults it is about
(a run in which nothing failed would prove nothing). The full-size runs: ``./taskw sim``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from cloud_hub.broker import find_mosquitto
from sim.emulate import run_emulation

pytestmark = pytest.mark.integration

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"

#: What each scenario must have done, beyond the invariants.
FAULTS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "rural-outages": lambda r: r["faults"]["outage_share"] >= 0.2 and {"reset", "blackhole"} <= set(r["faults"]["link_outages_by_mode"])
    and r["agents"]["zmq"] >= 1,
    "power-cuts": lambda r: r["faults"]["agent_kills"] >= 3,
    "broker-restart": lambda r: r["faults"]["broker_restarts"] >= 2,
    "hub-restart": lambda r: r["faults"]["hub_restarts"] >= 2,
    "flapping": lambda r: r["faults"]["link_outages"] >= 8,
    # two sites behind gateways (docs/sites.md): uplinks and LAN links cut, gateway A power-cut
    # a device moves from site A's gateway to site B's; the same fleet runs again without gateways
    "village": lambda r: r["faults"]["agent_kills"] >= 1 and r["faults"]["link_outages"] >= 8
    and [(m["agent"], m["from"], m["to"]) for m in r["sites"]["moves"]] == [("farma-1", "gwa", "gwb")]
    and r["without_gateways"]["invariants"]["ok"] is True and "comparison" in r,
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_reduced_scenario_delivers_every_task_exactly_once(name: str, tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required: run ./taskw setup (apt-get install mosquitto)")
    report = run_emulation(SCENARIOS / f"{name}.yaml", reduced=True, out_dir=tmp_path / "out", workdir=tmp_path / "work",
                           echo=lambda _: None)
    inv = report["invariants"]
    assert inv["accepted"] == inv["planned"] > 0
    assert (inv["lost"], inv["duplicated"], inv["wrong_results"]) == (0, 0, 0), inv["examples"]
    assert not inv["unexpected_errors"] and inv["expected_errors"] > 0
    assert report["faults"]["errors"] == []
    assert FAULTS[name](report), report["faults"]
    assert report["ok"] is True, report["expectations"]
    assert report["executions"]["delivered_without_a_logged_run"] == 0
    if "comparison" in report:  # a site scenario: what the gateways changed, measured against the same fleet without them
        comp = report["comparison"]
        base = report["without_gateways"]["invariants"]
        assert base["accepted"] == base["planned"] and (base["lost"], base["duplicated"], base["wrong_results"]) == (0, 0, 0)
        assert comp["uplink_bytes"]["gateways"] > 0 and comp["uplink_bytes"]["without_gateways"] > 0
        assert all(s["gateways"]["uplink_down_share"] > 0 for s in comp["per_site"].values()), comp
        print(f"{name}: {comp['uplink_bytes']}, tasks done during uplink outages {comp['tasks_done_during_uplink_outage']}")
    png = Path(report["files"]["timeline"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
