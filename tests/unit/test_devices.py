"""Device profiles and the cgroup arithmetic (pure: no cgroups, no root needed), the scenario
validation of ``device:`` and ``fl:``, and the fsync shim (built with the system compiler and
run in a real child process, when a compiler is there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.emulate.devices import (
    PROFILES, DeviceProfile, UnknownDevice, controller_settings, parse_hierarchies, pick_cpus, plan_cgroups, profile,
)
from sim.emulate.scenario import ScenarioError, load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"

# A hybrid (v1 + unified) container, as on this VM: memory nested under the runner's own cgroup,
# cpu and cpuset at their roots.
HYBRID_CGROUP = """12:pids:/
4:memory:/process_api/abc
3:cpuset:/
1:cpu:/
9:name=systemd:/
0::/
"""
HYBRID_MOUNTINFO = """25 20 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
30 25 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
31 25 0:28 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
32 25 0:29 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
33 25 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# Pure v2 (systemd), inside a delegated user slice.
V2_CGROUP = "0::/user.slice/user-1000.slice/session-3.scope\n"
V2_MOUNTINFO = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def test_pi_zero_profile_is_one_core_at_a_quarter_with_512_mb_and_slow_fsync() -> None:
    p = profile("pi-zero-2w")
    assert (p.cpus, p.cpu_quota_us, p.memory_bytes, p.fsync_delay_ms) == (1, 25_000, 512 * 2**20, 15.0)


def test_unknown_profile_is_a_clear_error_naming_the_known_ones() -> None:
    with pytest.raises(UnknownDevice, match=r"unknown device profile 'pi-zero-3' \(known: .*pi-zero-2w"):
        profile("pi-zero-3")


def test_profiles_are_validated() -> None:
    with pytest.raises(ValueError):
        DeviceProfile(name="x", cpu_quota=0)
    with pytest.raises(ValueError):
        DeviceProfile(name="x", memory_mb=512, swap=True)  # type: ignore[call-arg]
    assert all(isinstance(p, DeviceProfile) for p in PROFILES.values())


def test_hybrid_v1_layout_nests_every_controller_under_our_own_cgroup() -> None:
    hier = parse_hierarchies(HYBRID_CGROUP, HYBRID_MOUNTINFO)
    plan = plan_cgroups(hier, "mesh-sim-1-x")
    assert plan.version == 1
    assert plan.by_controller == {
        "memory": "/sys/fs/cgroup/memory/process_api/abc/mesh-sim-1-x",
        "cpu": "/sys/fs/cgroup/cpu/mesh-sim-1-x",
        "cpuset": "/sys/fs/cgroup/cpuset/mesh-sim-1-x",
    }
    assert plan.procs_files("pi-0") == [
        "/sys/fs/cgroup/cpu/mesh-sim-1-x/pi-0/cgroup.procs",
        "/sys/fs/cgroup/cpuset/mesh-sim-1-x/pi-0/cgroup.procs",
        "/sys/fs/cgroup/memory/process_api/abc/mesh-sim-1-x/pi-0/cgroup.procs",
    ]


def test_v2_layout_is_one_directory_and_needs_the_controllers() -> None:
    hier = parse_hierarchies(V2_CGROUP, V2_MOUNTINFO)
    plan = plan_cgroups(hier, "run", v2_controllers=frozenset({"cpu", "memory", "cpuset", "io"}))
    assert plan.version == 2 and plan.run_dirs == ("/sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope/run",)
    assert plan.procs_files("a") == ["/sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope/run/a/cgroup.procs"]
    with pytest.raises(ValueError, match="lacks the cpuset controller"):
        plan_cgroups(hier, "run", v2_controllers=frozenset({"cpu", "memory"}))


def test_no_cgroups_mounted_says_so() -> None:
    with pytest.raises(ValueError, match="no cgroup hierarchy"):
        plan_cgroups(parse_hierarchies("", ""), "run")


def test_container_mount_root_is_stripped() -> None:
    # a container whose own cgroup is mounted as the hierarchy's root
    hier = parse_hierarchies("0::/docker/123\n", "40 30 0:30 /docker/123 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    assert hier[0].own_dir == "/sys/fs/cgroup"


def test_controller_files_per_version() -> None:
    p = profile("pi-zero-2w")
    v1 = controller_settings(p, 1, "1", "0")
    assert ("cpu.cfs_quota_us", "25000") in v1["cpu"] and ("memory.limit_in_bytes", str(512 * 2**20)) in v1["memory"]
    assert v1["cpuset"] == [("cpuset.cpus", "1"), ("cpuset.mems", "0")]
    v2 = controller_settings(p, 2, "0", "0")
    assert v2["cpu"] == [("cpu.max", "25000 100000")] and ("memory.max", str(512 * 2**20)) in v2["memory"]


def test_cores_rotate_over_agents() -> None:
    assert [pick_cpus("0-1", 1, s) for s in range(3)] == ["0", "1", "0"]
    assert pick_cpus("0-3,6", 2, 1) == "2,3"
    assert pick_cpus("0", 4, 0) == "0"


def test_scenario_rejects_an_unknown_device_and_unknown_fl_group() -> None:
    base = {"name": "x", "duration_s": 5, "workload": {"tasks": 1, "mix": {"echo": 1}}}
    with pytest.raises(ScenarioError, match=r"agents\.0\.device: .*unknown device profile 'pi-zero-3'"):
        load_scenario({**base, "agents": [{"name": "a", "count": 1, "device": "pi-zero-3"}]})
    with pytest.raises(ScenarioError, match="fl.groups names unknown group 'b'"):
        load_scenario({**base, "agents": [{"name": "a", "count": 1}], "fl": {"groups": ["b"]}})


def test_shipped_small_devices_scenario_is_valid_in_both_sizes() -> None:
    for reduced in (False, True):
        sc = load_scenario(SCENARIOS / "small-devices.yaml", reduced=reduced)
        assert all(g.device == "pi-zero-2w" for g in sc.agents) and sc.fl is not None
    assert load_scenario(SCENARIOS / "small-devices.yaml", reduced=True).n_agents == 2


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler to build the fsync shim")
def test_fsync_shim_slows_and_counts_flushes_across_processes(tmp_path: Path) -> None:
    from sim.emulate.constrain import build_fsync_shim, fsync_env, read_fsync_counter

    so = build_fsync_shim(tmp_path / "cache")
    assert build_fsync_shim(tmp_path / "cache") == so  # cached
    counter = tmp_path / "count"
    code = ("import os, subprocess, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); t = time.perf_counter(); "
            "[os.fsync(fd) for _ in range(4)]; os.fdatasync(fd); print(time.perf_counter() - t); "
            "subprocess.run([sys.executable, '-c', 'import os, sys; os.fsync(os.open(sys.argv[1], os.O_RDONLY))', sys.argv[1]], check=True)")
    env = dict(os.environ, **fsync_env(so, delay_ms=20, counter=counter))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], env=env, capture_output=True, text=True, check=True)
    assert read_fsync_counter(counter) == {"fsync": 5, "fdatasync": 1}  # the child's flush counts too
    assert float(out.stdout) >= 5 * 0.020  # five flushes, each at least the delay (a lower bound, not a timing)


def test_a_machine_that_cannot_emulate_the_device_skips_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler (here: CC names one that does not exist, and the shim cache is empty): the
    scenario is skipped before anything starts, with the reason, and reports ok."""
    from sim.emulate import run_emulation

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    report = run_emulation(SCENARIOS / "small-devices.yaml", reduced=True, out_dir=tmp_path / "out", workdir=tmp_path / "work",
                           echo=lambda _: None)
    assert report["ok"] is True and "no-such-cc" in report["skipped"] and "fsync shim" in report["skipped"]
    assert (tmp_path / "out" / "report.json").exists() and not (tmp_path / "work").exists()
