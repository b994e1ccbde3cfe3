"""Cold-start time per execution environment, in the style of funcX's Table 4 (docs/environments.md).

For each kind, a fresh LocalEngine with no worker up (on demand) runs one no-op and we time
submit -> result; the warm round trip on the same engine is printed next to it. Kinds:

* ``bare worker``: the agent's own Python (the baseline of this run);
* ``cached venv``: a uv venv already on disk (worker started from its interpreter);
* ``new venv``: resolve + build the venv (uv, from a local wheel, ``--no-index --find-links``:
  nothing is downloaded; an index adds the download), then start the worker;
* ``bubblewrap``: a sandboxed worker (read-only root, private /tmp, no network);
* ``bubblewrap + cached venv``;
* ``container``: Apptainer where installed and able to start, the host's root as a staged rootfs
  directory (nothing is pulled); otherwise the row says why.

Also per kind: the worker's RSS, the disk the environment takes (what an SD card must write once)
and what crosses the link (the spec in each task frame; the wheel bytes a new venv fetches).

    .venv/bin/python bench/coldstart.py [--reps 5] [--quick] [--smoke] [--no-save]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (sets sys.path: the repository first)
from _common import finish, header, log

import psutil

from mesh_agent.engine import LocalEngine
from mesh_agent.engine.environments import Environments
from mesh_agent.protocol.environment import encode, normalize
from mesh_agent.protocol.serialize import deserialize, function_id, serialize, serialize_function
from tests.fixtures.wheels import build_wheel


def noop() -> int:
    return 0


_BODY = serialize_function(noop)


def _task(i: str, spec: dict[str, Any] | None) -> Any:
    from mesh_agent.engine import EngineTask

    return EngineTask(i, function_id(_BODY), _BODY, serialize(((), {})), None, spec)


def _tree_rss(pid: int) -> int:
    """RSS of a worker and its children (bwrap's sandboxed python is a child of bwrap)."""
    try:
        p = psutil.Process(pid)
        return sum(x.memory_info().rss for x in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


async def _one(envs: Environments | None, spec: dict[str, Any] | None) -> dict[str, Any]:
    """A fresh engine with no worker: cold submit -> result, then a warm one."""
    got: asyncio.Queue[Any] = asyncio.Queue()
    eng = LocalEngine(lambda rs: [got.put_nowait(r) for r in rs], workers=1, idle_s=600.0, environments=envs)
    await eng.start()
    try:
        t0 = time.perf_counter()
        eng.submit([_task("cold", spec)])
        r = await asyncio.wait_for(got.get(), 600)
        cold = time.perf_counter() - t0
        if not r.ok:
            return {"error": deserialize(r.data)["message"]}
        t1 = time.perf_counter()
        eng.submit([_task("warm", spec)])
        r2 = await asyncio.wait_for(got.get(), 60)
        warm = time.perf_counter() - t1
        assert r2.ok
        rss = _tree_rss(eng._workers[0].pid) if eng._workers else 0
        return {"cold_s": cold, "warm_s": warm, "rss": rss}
    finally:
        await eng.stop(grace=1.0)


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in p.rglob("*") if f.is_file() and not f.is_symlink()) if p.exists() else 0


async def run(reps: int, work: Path) -> dict[str, Any]:
    wheels = work / "wheels"
    wheel = build_wheel(wheels, "meshtoy", "1.0", padding=2_000_000)  # stands in for a 2 MB package
    pip = normalize({"pip": ["meshtoy"]})
    rows: dict[str, dict[str, Any]] = {}

    def envs_at(root: Path) -> Environments:
        return Environments(root, hidden=[work / "agent-data"], no_index=True, find_links=[str(wheels)])

    (work / "agent-data").mkdir()
    cached_root = work / "agent-data" / "envs-cached"
    cached = envs_at(cached_root)  # one agent's environments: built and probed once, outside the timing
    first_use_ms: dict[str, float] = {}  # what preparing each kind costs once per agent process (build, probe)
    for name, spec in (("cached venv (the build)", pip), ("bubblewrap (the probe)", normalize({"sandbox": True})),
                       ("bubblewrap + cached venv (the probe)", normalize({"sandbox": True, "pip": ["meshtoy"]}))):
        t0 = time.perf_counter()
        await cached.kind(spec)
        first_use_ms[name] = round((time.perf_counter() - t0) * 1000, 1)
    venv_disk = _dir_bytes(cached_root / "venvs")
    cache_disk = _dir_bytes(cached_root / "uv-cache")
    kinds: list[tuple[str, Any, dict[str, Any] | None, dict[str, Any]]] = [
        ("bare worker", lambda i: None, None, {}),
        ("cached venv", lambda i: cached, pip, {"disk_mb": round(venv_disk / 2**20, 2)}),
        ("new venv", lambda i: envs_at(work / "agent-data" / f"envs-new-{i}"), pip,
         {"disk_mb": round(venv_disk / 2**20, 2), "uv_cache_mb": round(cache_disk / 2**20, 2),
          "fetched_bytes": wheel.stat().st_size, "fetched_from": "local --find-links (an index adds the download)"}),
        ("bubblewrap", lambda i: cached, normalize({"sandbox": True}), {}),
        ("bubblewrap + cached venv", lambda i: cached, normalize({"sandbox": True, "pip": ["meshtoy"]}), {}),
    ]
    runtime = next((r for r in ("apptainer", "singularity", "podman") if shutil.which(r)), None)
    if runtime is None:
        rows["container"] = {"available": False, "why": "no container runtime installed (apptainer, singularity, podman)"}
        log("container: not available (no runtime installed)")
    else:
        kinds.append(("container", lambda i: cached, normalize({"container": "/"}), {}))
    samples: dict[str, list[dict[str, Any]]] = {k[0]: [] for k in kinds}
    for i in range(reps):  # kinds interleaved, so load changes on a shared machine hit them alike
        for name, make, spec, _extra in kinds:
            if name in rows:
                continue
            got = await _one(make(i), spec)
            if "error" in got:
                rows[name] = {"available": False, "why": got["error"]}
                log(f"{name}: not available: {got['error']}")
                continue
            samples[name].append(got)
    for name, _make, spec, extra in kinds:
        if name in rows:
            continue
        ss = samples[name]
        colds = sorted(s["cold_s"] for s in ss)
        warms = sorted(s["warm_s"] for s in ss)
        rows[name] = {"available": True, "cold_ms_median": round(statistics.median(colds) * 1000, 1),
                      "cold_ms_min": round(colds[0] * 1000, 1), "cold_ms_max": round(colds[-1] * 1000, 1),
                      "warm_ms_median": round(statistics.median(warms) * 1000, 2),
                      "worker_rss_mb": round(statistics.median(s["rss"] for s in ss) / 2**20, 1),
                      "spec_bytes_per_task": len(encode(spec)) if spec else 0, **extra}
        log(f"{name}: cold {rows[name]['cold_ms_median']} ms (median of {len(ss)}), warm {rows[name]['warm_ms_median']} ms")
    base = rows["bare worker"]["cold_ms_median"]
    for r in rows.values():
        if r.get("available"):
            r["cold_vs_bare"] = round(r["cold_ms_median"] / base, 2)
    return {"rows": rows, "first_use_ms": first_use_ms, "wheel_bytes": wheel.stat().st_size,
            "heartbeat_bytes_per_held_env": len('"0123456789abcdef",')}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="cold starts per kind (default 5)")
    parser.add_argument("--quick", action="store_true", help="2 reps per kind")
    _common.add_smoke_arg(parser)
    parser.add_argument("--no-save", action="store_true", help="print the JSON but do not write bench/results/")
    parser.add_argument("--workdir", default=None, help="where the venvs go (default: /var/tmp)")
    args = parser.parse_args()
    reps = 2 if args.quick else max(1, min(args.reps, 50))
    if _common.smoke(args):
        reps = 1  # every kind once; nothing written under bench/results/
    started = time.monotonic()
    out = header("coldstart", args)
    work = Path(tempfile.mkdtemp(prefix="mesh-coldstart-", dir=args.workdir or "/var/tmp"))
    try:
        out.update(asyncio.run(run(reps, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["baseline"] = "bare worker (the agent's own Python), same run"
    finish("coldstart", out, args, started)
    # A full run reports an environment that cannot start here; a smoke run fails when one that
    # should start does not (bubblewrap installed, yet the sandbox did not run), so CI notices.
    broken = [k for k in ("bare worker", "cached venv", "new venv") if not out.get("rows", {}).get(k, {}).get("available")]
    if shutil.which("bwrap"):
        broken += [k for k in ("bubblewrap", "bubblewrap + cached venv") if not out.get("rows", {}).get(k, {}).get("available")]
    if _common.smoke(args) and broken:
        print(f"coldstart --smoke: {', '.join(broken)} did not run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
