"""Device profiles for emulated agents, and the pure arithmetic of putting one into cgroups.

A *device profile* says how small the emulated hardware is: how many cores the agent may run
on, what share of one core it gets (a CFS quota), how much memory its whole process tree may
hold (agent, workers, everything they start), and how slow a flush to its storage is (an SD
card: ``fsync`` takes milliseconds, not the 0.1 ms of this VM's disk). ``mesh-sim run`` agent
groups name one with ``device: pi-zero-2w``.

This module does no I/O: profiles, validation, and the path and file arithmetic for cgroup v1
and v2 (which files to write, under which directories) as functions of the text of
``/proc/self/cgroup`` and ``/proc/self/mountinfo``. :mod:`sim.emulate.constrain` does the
writing, so this part is unit-tested without root or cgroups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DeviceProfile", "PROFILES", "profile", "UnknownDevice", "Hierarchy", "parse_hierarchies", "CgroupPlan",
    "plan_cgroups", "controller_settings", "CPU_PERIOD_US",
]

#: CFS period: 100 ms, the kernel's default; the quota is a share of it.
CPU_PERIOD_US = 100_000


class DeviceProfile(BaseModel):
    """How small a device is. Limits apply to the agent's whole process tree."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    cpus: int = Field(1, ge=1, le=64, description="cores the tree may run on (cpuset)")
    cpu_quota: float = Field(1.0, gt=0, le=64, description="CPU time per wall second, in cores (0.25 = a quarter of one core)")
    memory_mb: int = Field(512, ge=32, le=1 << 20, description="hard memory limit of the tree (no swap)")
    fsync_delay_ms: float = Field(0.0, ge=0, le=10_000, description="added to every fsync/fdatasync (LD_PRELOAD shim)")

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb * 1024 * 1024

    @property
    def cpu_quota_us(self) -> int:
        return max(1000, int(round(self.cpu_quota * CPU_PERIOD_US)))


#: Shipped profiles. A Raspberry Pi Zero 2 W has four Cortex-A53 cores at 1 GHz and 512 MB; one
#: x86 core of this VM at a quarter of its time is about what one A53 core does for Python code,
#: and SD cards take 5-50 ms per flush (15 ms: a middling card).
PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(name="pi-zero-2w", description="Raspberry Pi Zero 2 W: 1 core at 25 %, 512 MB, SD card fsync 15 ms",
                      cpus=1, cpu_quota=0.25, memory_mb=512, fsync_delay_ms=15.0),
        DeviceProfile(name="pi-zero-w", description="Raspberry Pi Zero W (first generation, one ARM11 core): 1 core at 10 %, "
                      "512 MB, SD card fsync 20 ms", cpus=1, cpu_quota=0.10, memory_mb=512, fsync_delay_ms=20.0),
        DeviceProfile(name="pi-4-2g", description="Raspberry Pi 4 (2 GB): 2 cores at 50 % each, 2 GB, SD card fsync 8 ms",
                      cpus=2, cpu_quota=1.0, memory_mb=2048, fsync_delay_ms=8.0),
    )
}


class UnknownDevice(ValueError):
    """A scenario named a device profile that does not exist."""


def profile(name: str) -> DeviceProfile:
    """The shipped profile ``name``, or :class:`UnknownDevice` naming the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownDevice(f"unknown device profile {name!r} (known: {', '.join(sorted(PROFILES))})") from None


# ---------------------------------------------------------------------------- cgroup arithmetic
Version = Literal[1, 2]
#: The controllers a profile needs: memory (limit, peak, OOM kills), cpu (quota), cpuset (cores).
CONTROLLERS = ("memory", "cpu", "cpuset")


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy: its controllers, where it is mounted, and the directory of
    this process's own cgroup in it (where our children may be created)."""

    version: Version
    controllers: frozenset[str]
    mount_point: str
    own_dir: str


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3 or rf[0] not in ("cgroup", "cgroup2"):
            continue
        root, point = lf[3].replace("\\040", " "), lf[4].replace("\\040", " ")
        out.append((rf[0], root, point, rf[2]))
    return out


def _join(mount_point: str, mount_root: str, path: str) -> str:
    """Directory of cgroup ``path`` (as /proc/self/cgroup names it) under a mount whose root is
    ``mount_root`` (a container often sees its own cgroup mounted as ``/``)."""
    p, r = PurePosixPath(path), PurePosixPath(mount_root)
    try:
        rel = p.relative_to(r)
    except ValueError:
        rel = PurePosixPath(str(p).lstrip("/"))
    return str(PurePosixPath(mount_point) / rel)


def parse_hierarchies(proc_cgroup: str, mountinfo: str) -> list[Hierarchy]:
    """The cgroup hierarchies this process is in, from ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo``. v1 hierarchies carry their controllers in the mount options; the
    v2 (unified) one is listed with an empty controller set here (its controllers are in the
    ``cgroup.controllers`` file, read by the I/O side)."""
    mounts = _mounts(mountinfo)
    out: list[Hierarchy] = []
    for line in proc_cgroup.splitlines():
        m = re.match(r"^(\d+):([^:]*):(.*)$", line.strip())
        if not m:
            continue
        hid, ctrls, path = m.groups()
        if hid == "0" and ctrls == "":
            for fstype, root, point, _ in mounts:
                if fstype == "cgroup2":
                    out.append(Hierarchy(2, frozenset(), point, _join(point, root, path)))
                    break
            continue
        names = frozenset(c for c in ctrls.split(",") if c)
        for fstype, root, point, opts in mounts:
            if fstype == "cgroup" and names and names <= set(opts.split(",")):
                out.append(Hierarchy(1, names, point, _join(point, root, path)))
                break
    return out


@dataclass(frozen=True)
class CgroupPlan:
    """Where one emulation run's cgroups go: ``run_dirs`` (one per hierarchy, created first and
    removed last) and, per agent, the directories its process is written into."""

    version: Version
    run_dirs: tuple[str, ...]
    #: controller -> hierarchy's run directory (v2: the same directory for all)
    by_controller: dict[str, str]

    def agent_dirs(self, agent: str) -> dict[str, str]:
        """controller -> the agent's own cgroup directory."""
        return {c: str(PurePosixPath(d) / agent) for c, d in self.by_controller.items()}

    def procs_files(self, agent: str) -> list[str]:
        """Files the agent's pid is written to (once per hierarchy) before it execs."""
        dirs = sorted(set(self.agent_dirs(agent).values()))
        return [str(PurePosixPath(d) / "cgroup.procs") for d in dirs]


def plan_cgroups(hierarchies: list[Hierarchy], run: str, *, v2_controllers: frozenset[str] = frozenset()) -> CgroupPlan:
    """Choose the hierarchy layout for a run named ``run``: cgroup v1 where the three
    controllers are mounted as v1 hierarchies (a hybrid machine), else v2 with
    ``v2_controllers`` (read from its ``cgroup.controllers``). Every directory is a child of
    this process's own cgroup, so the limits nest inside whatever already limits us. Raises
    ``ValueError`` saying what is missing."""
    v1 = {c: h for h in hierarchies if h.version == 1 for c in h.controllers}
    if all(c in v1 for c in CONTROLLERS):
        by = {c: str(PurePosixPath(v1[c].own_dir) / run) for c in CONTROLLERS}
        return CgroupPlan(1, tuple(sorted(set(by.values()))), by)
    v2 = next((h for h in hierarchies if h.version == 2), None)
    if v2 is not None:
        missing = [c for c in CONTROLLERS if c not in v1 and c not in v2_controllers]
        if not missing:
            d = str(PurePosixPath(v2.own_dir) / run)
            return CgroupPlan(2, (d,), {c: d for c in CONTROLLERS})
        raise ValueError(f"cgroup v2 at {v2.mount_point} lacks the {', '.join(missing)} controller(s)")
    missing = [c for c in CONTROLLERS if c not in v1]
    raise ValueError(f"no cgroup hierarchy with the {', '.join(missing)} controller(s) is mounted")


def controller_settings(p: DeviceProfile, version: Version, cpus: str, mems: str) -> dict[str, list[tuple[str, str]]]:
    """Files to write in an agent's cgroup, per controller, in order (``cpus``: the cores it
    gets, e.g. ``"1"``; ``mems``: memory nodes, e.g. ``"0"``). cpuset comes first in v1: a task
    cannot join a cpuset cgroup whose cpus or mems are empty."""
    quota = str(p.cpu_quota_us)
    if version == 1:
        return {
            "cpuset": [("cpuset.cpus", cpus), ("cpuset.mems", mems)],
            "cpu": [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", quota)],
            # memsw (memory + swap) only where swap accounting exists; written after the plain limit
            "memory": [("memory.limit_in_bytes", str(p.memory_bytes)), ("memory.memsw.limit_in_bytes?", str(p.memory_bytes))],
        }
    return {
        "cpuset": [("cpuset.cpus", cpus), ("cpuset.mems", mems)],
        "cpu": [("cpu.max", f"{quota} {CPU_PERIOD_US}")],
        "memory": [("memory.max", str(p.memory_bytes)), ("memory.swap.max?", "0")],
    }


def pick_cpus(available: str, n: int, slot: int) -> str:
    """``n`` cores out of ``available`` (a cpuset list such as ``"0-3,6"``) for the agent in
    ``slot``, rotating so that agents spread over the machine's cores."""
    cores: list[int] = []
    for part in available.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            cores.extend(range(int(a), int(b) + 1))
        else:
            cores.append(int(part))
    if not cores:
        raise ValueError(f"no cores in cpuset {available!r}")
    n = min(n, len(cores))
    chosen = sorted({cores[(slot * n + i) % len(cores)] for i in range(n)})
    return ",".join(map(str, chosen))
