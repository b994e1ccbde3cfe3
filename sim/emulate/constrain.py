"""Puts emulated agents on emulated small devices: cgroups for CPU and memory, an LD_PRELOAD shim
for slow fsync. The I/O half of :mod:`sim.emulate.devices` (which holds the pure arithmetic).

* **cgroups.** One directory per run under this process's own cgroup in each hierarchy (so the
  limits nest inside whatever limits us already), one per agent below it, with the profile's
  cpuset, CFS quota and hard memory limit (no swap). An agent joins its cgroups before it runs
  a line of Python: it is started as ``sh -c 'echo $$ > .../cgroup.procs ...; exec python ...'``,
  so its workers are born inside. Peak memory and OOM kills are read back at the end
  (v1: ``memory.max_usage_in_bytes``, ``memory.oom_control``; v2: ``memory.peak``,
  ``memory.events``).
* **fsync.** ``_fsync_shim.c``, compiled with the system C compiler into a cache directory the
  first time, wraps ``fsync``/``fdatasync``: the real call, then a sleep; it also counts them in
  a shared file (used by ``bench/footprint.py``).

Where any of this is impossible (no cgroup controllers, not writable, no compiler), the probe
says why, in one line, and the caller skips with that reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cloud_hub.localmesh import AgentProcess

from .devices import CgroupPlan, DeviceProfile, controller_settings, parse_hierarchies, pick_cpus, plan_cgroups

__all__ = ["Unavailable", "unavailable_reason", "build_fsync_shim", "read_fsync_counter", "CgroupRun", "ConstrainedAgent", "fsync_env"]

SHIM_SOURCE = Path(__file__).with_name("_fsync_shim.c")


class Unavailable(RuntimeError):
    """This machine cannot emulate the device (the message says why, in one line)."""


# ---------------------------------------------------------------------------- fsync shim
def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "continuum-mesh"


def build_fsync_shim(cache_dir: Path | None = None) -> Path:
    """The compiled shim (``.so``), built once per source version into ``cache_dir``."""
    src = SHIM_SOURCE.read_bytes()
    out_dir = Path(cache_dir) if cache_dir is not None else _cache_dir()
    so = out_dir / f"fsync-shim-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if so.exists():
        return so
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        raise Unavailable("no C compiler (gcc, cc or clang) to build the fsync shim: apt-get install gcc")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        try:
            r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SHIM_SOURCE), "-ldl"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"cannot run the C compiler {cc!r} to build the fsync shim: {exc}") from None
        if r.returncode != 0:
            raise Unavailable(f"building the fsync shim with {cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(tmp, so)  # atomic: a concurrent build never sees half a file
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return so


def fsync_env(shim: Path, *, delay_ms: float = 0.0, counter: Path | None = None) -> dict[str, str]:
    """Environment that loads the shim into a process and its children."""
    pre = os.environ.get("LD_PRELOAD", "")
    env = {"LD_PRELOAD": f"{shim}{' ' + pre if pre else ''}", "MESH_FSYNC_DELAY_MS": f"{delay_ms:g}"}
    if counter is not None:
        env["MESH_FSYNC_COUNTER"] = str(counter)
    return env


def read_fsync_counter(path: Path) -> dict[str, int]:
    """``{"fsync": n, "fdatasync": m}`` from a shim counter file (zeros if none was written)."""
    try:
        raw = Path(path).read_bytes()[:16]
    except FileNotFoundError:
        raw = b""
    a, b = struct.unpack("<QQ", raw.ljust(16, b"\0"))
    return {"fsync": a, "fdatasync": b}


# ---------------------------------------------------------------------------- cgroups
def _read(path: str | Path) -> str:
    return Path(path).read_text()


def _write(path: str | Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CgroupRun:
    """The cgroups of one emulation run: ``probe()``, ``add(agent, profile, slot)`` for each
    agent, ``stats(agent)`` at the end, then ``remove()``."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.plan: CgroupPlan | None = None
        self.profiles: dict[str, DeviceProfile] = {}
        self._made: list[str] = []  # directories made, in creation order

    def probe(self) -> "CgroupRun":
        """Lay out and create the run's directories; :class:`Unavailable` if this machine cannot."""
        try:
            hier = parse_hierarchies(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"))
        except OSError as exc:
            raise Unavailable(f"cannot read this process's cgroups: {exc}") from None
        v2 = next((h for h in hier if h.version == 2), None)
        v2_ctrls: frozenset[str] = frozenset()
        if v2 is not None:
            with contextlib.suppress(OSError):
                v2_ctrls = frozenset(_read(Path(v2.own_dir) / "cgroup.controllers").split())
        try:
            plan = plan_cgroups(hier, self.run, v2_controllers=v2_ctrls)
        except ValueError as exc:
            raise Unavailable(str(exc)) from None
        self.plan = plan
        try:
            for d in plan.run_dirs:
                os.mkdir(d)
                self._made.append(d)
            if plan.version == 1:
                cs = Path(plan.by_controller["cpuset"])  # a v1 cpuset child starts empty: copy the parent's
                for f in ("cpuset.cpus", "cpuset.mems"):
                    _write(cs / f, _read(cs.parent / f).strip())
            else:
                self._delegate_v2(Path(plan.run_dirs[0]))
        except OSError as exc:
            self.remove()
            raise Unavailable(f"cgroup {plan.run_dirs[0] if plan.run_dirs else '?'} is not writable here: {exc.strerror or exc}") from None
        return self

    @staticmethod
    def _delegate_v2(run_dir: Path) -> None:
        want = {"memory", "cpu", "cpuset"}
        have = set(_read(run_dir / "cgroup.controllers").split())
        if not want <= have:
            parent = run_dir.parent
            try:  # only possible where the parent holds no processes of its own
                _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(want - have)))
            except OSError as exc:
                raise OSError(exc.errno, f"{parent} does not delegate {', '.join(sorted(want - have))} to its children "
                                         f"(it holds processes; start under `systemd-run --scope -p Delegate=yes`)") from None
        _write(run_dir / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(want)))

    def add(self, agent: str, prof: DeviceProfile, slot: int) -> list[str]:
        """Create ``agent``'s cgroups with ``prof``'s limits; returns its ``cgroup.procs`` files."""
        assert self.plan is not None, "probe() first"
        plan = self.plan
        dirs = plan.agent_dirs(agent)
        cs_parent = Path(plan.by_controller["cpuset"])
        avail = _read(cs_parent / ("cpuset.cpus" if plan.version == 1 else "cpuset.cpus.effective")).strip()
        mems = _read(cs_parent / ("cpuset.mems" if plan.version == 1 else "cpuset.mems.effective")).strip() or "0"
        settings = controller_settings(prof, plan.version, pick_cpus(avail, prof.cpus, slot), mems)
        for d in sorted(set(dirs.values())):
            if not os.path.isdir(d):
                os.mkdir(d)
                self._made.append(d)
        for ctrl in ("cpuset", "cpu", "memory"):
            for fname, value in settings[ctrl]:
                optional = fname.endswith("?")
                path = Path(dirs[ctrl]) / fname.rstrip("?")
                if optional and not path.exists():
                    continue
                _write(path, value)
        self.profiles[agent] = prof
        return plan.procs_files(agent)

    def stats(self, agent: str) -> dict[str, Any]:
        """Peak memory, limit and OOM kills of ``agent``'s tree (since its cgroup was made)."""
        assert self.plan is not None
        mem = Path(self.plan.agent_dirs(agent)["memory"])
        out: dict[str, Any] = {"limit_bytes": self.profiles[agent].memory_bytes}
        if self.plan.version == 1:
            out["peak_bytes"] = int(_read(mem / "memory.max_usage_in_bytes"))
            out["limit_hits"] = int(_read(mem / "memory.failcnt"))
            events = dict(line.split() for line in _read(mem / "memory.oom_control").splitlines() if len(line.split()) == 2)
            out["oom_kills"] = int(events.get("oom_kill", 0))
        else:
            peak = mem / "memory.peak"
            out["peak_bytes"] = int(_read(peak)) if peak.exists() else None
            events = dict(line.split() for line in _read(mem / "memory.events").splitlines() if len(line.split()) == 2)
            out["limit_hits"] = int(events.get("max", 0))
            out["oom_kills"] = int(events.get("oom_kill", 0))
        stat = Path(self.plan.agent_dirs(agent)["cpu"]) / "cpu.stat"
        with contextlib.suppress(OSError):
            st = dict(line.split() for line in _read(stat).splitlines() if len(line.split()) == 2)
            out["cpu_throttled"] = int(st.get("nr_throttled", 0))
        out["peak_mb"] = None if out.get("peak_bytes") is None else round(out["peak_bytes"] / 2**20, 1)
        out["within_limit"] = out["oom_kills"] == 0 and (out["peak_bytes"] is None or out["peak_bytes"] <= out["limit_bytes"])
        return out

    def remove(self) -> None:
        """SIGKILL whatever is still in the run's cgroups (only what this run started), then
        remove the directories, children first."""
        for d in reversed(self._made):
            procs = Path(d) / "cgroup.procs"
            for _ in range(20):
                try:
                    pids = [int(p) for p in _read(procs).split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
            with contextlib.suppress(OSError):
                os.rmdir(d)
        self._made.clear()


class ConstrainedAgent(AgentProcess):
    """An :class:`AgentProcess` that joins its cgroups before Python starts and runs with the
    fsync shim preloaded. Same config, queue and log as the agent it wraps."""

    def __init__(self, base: AgentProcess, procs_files: list[str], env: dict[str, str]) -> None:
        super().__init__(base.cfg, base.config_path, base.log_path)
        self.procs_files = list(procs_files)
        self.extra_env = dict(env)

    def start(self) -> "ConstrainedAgent":
        join = " && ".join(f"echo $$ > {shlex.quote(p)}" for p in self.procs_files) or ":"
        cmd = ["/bin/sh", "-c", f'{join} && exec "$0" "$@"',
               sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(self.config_path)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self


def unavailable_reason(devices: list[str]) -> str | None:
    """Why this machine cannot emulate these device profiles (None: it can). Builds the shim
    and creates, then removes, a probe cgroup."""
    if not devices:
        return None
    try:
        build_fsync_shim()
        CgroupRun(f"mesh-sim-probe-{os.getpid()}").probe().remove()
    except Unavailable as exc:
        return str(exc)
    return None
