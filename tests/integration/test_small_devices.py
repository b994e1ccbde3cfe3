"""The small-devices scenario, reduced: MQTT agents on emulated Pi Zero 2 W (cgroups: one core at
25 %, 512 MB; fsync +15 ms through the LD_PRELOAD shim) run a task workload and a FedAvg run at
once. Nothing may be lost, the FL run must finish, and each device's cgroup must show its memory
peak under the limit with no OOM kill. Skips, with the reason, where cgroups are unavailable."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from sim.emulate import run_emulation

pytestmark = pytest.mark.integration

SCENARIO = Path(__file__).resolve().parents[2] / "sim" / "scenarios" / "small-devices.yaml"


def test_small_devices_lose_nothing_and_stay_under_their_memory_limit(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required: run ./taskw setup (apt-get install mosquitto)")
    report = run_emulation(SCENARIO, reduced=True, out_dir=tmp_path / "out", workdir=tmp_path / "work", echo=lambda _: None)
    if report.get("skipped"):
        pytest.skip(f"small-devices: {report['skipped']}")
    inv = report["invariants"]
    assert inv["accepted"] == inv["planned"] > 0
    assert (inv["lost"], inv["duplicated"], inv["wrong_results"]) == (0, 0, 0), inv["examples"]
    assert not inv["unexpected_errors"] and report["faults"]["errors"] == []
    fl = report["fl"]
    assert fl["ok"] and fl["status"] == "finished" and fl["rounds_done"] == fl["rounds_planned"], fl
    devices = report["devices"]
    assert set(devices) == {"pi-0", "pi-1"}
    for name, d in devices.items():
        assert d["oom_kills"] == 0 and 0 < d["peak_bytes"] <= d["limit_bytes"] == 512 * 2**20, (name, d)
        assert d["cpu_throttled"] > 0, (name, d)  # the 25 % quota really bit
        assert d["flushes"]["fsync"] + d["flushes"]["fdatasync"] > 0, (name, d)  # the shim was loaded in the tree
    assert report["ok"] is True, report["expectations"]


def test_unknown_device_profile_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from sim.emulate import ScenarioError

    bad = {"name": "x", "duration_s": 5, "agents": [{"name": "a", "count": 1, "device": "pi-zero-3"}],
           "workload": {"tasks": 1, "mix": {"echo": 1}}}
    with pytest.raises(ScenarioError, match="unknown device profile 'pi-zero-3'"):
        run_emulation(bad, out_dir=tmp_path / "out", workdir=tmp_path / "work", echo=lambda _: None)
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
