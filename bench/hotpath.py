"""The hub's hot path, stage by stage: CPU per task for each stage of a no-op's way through the
hub and the agent, batched and sequential, next to Parsl HTEX's whole CPU per task in the same run.

Mesh: a LocalMesh per transport (real Mosquitto, hub as its own process, one agent process with
2 workers), started with ``MESH_COST_LEDGER`` set, so the hub and the agent keep the CPU ledger of
mesh_agent/costs.py and write it every half second. Each phase reads both ledgers before and
after and divides the difference by the tasks done:

* ``batched``: N ``Executor.submit(noop)`` calls (the SDK batches them), then every future waited for;
* ``sequential``: M ``submit(noop).result()`` round trips, one after the other.

Per process it reports, in us of CPU per task: every stage (``hub.*`` on the event loop,
``db.*`` on the database threads, ``agent.*``), what each thread spent in all, and what the
stages leave unaccounted on that thread (the event loop's own work, uvicorn and websockets
framing, the transports' libraries). The agent's worker processes and the SDK (this process)
are reported as totals. Stage names are listed in docs/benchmarks.md.

Parsl: the same N batched and M sequential no-ops through HTEX with 2 local workers (its
defaults otherwise, ``_common.PARSL_SETTINGS``); its CPU per task is this process (the DFK and
the executor's threads) plus its interchange and worker pool processes, from psutil.

    python bench/hotpath.py [--tasks 5000] [--seq 300] [--transports zmq,mqtt] [--no-parsl] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import _common as c
import psutil

PHASE_BUDGET_S = 120.0
TARGETS = {"batched_hub_us": 60.0, "sequential_hub_us": 2000.0}  # issue 30


def noop() -> None:
    return None


# ---------------------------------------------------------------- ledgers
def _read_ledgers(folder: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in folder.glob("*.json"):
        try:
            out[f.stem.split("-")[0]] = json.loads(f.read_text())
        except (OSError, ValueError):  # being replaced right now: read again
            time.sleep(0.05)
            out[f.stem.split("-")[0]] = json.loads(f.read_text())
    return out


def fresh_ledgers(folder: Path, roles: tuple[str, ...] = ("hub", "agent"), timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """Both ledgers, written after this call started (each process writes every 0.5 s)."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = {f.stem.split("-")[0]: f for f in folder.glob("*.json")}
        if all(r in files and files[r].stat().st_mtime > since + 0.01 for r in roles):
            return _read_ledgers(folder)
        time.sleep(0.1)
    raise RuntimeError(f"no fresh cost ledger from {roles} in {folder} within {timeout_s:g} s (MESH_COST_LEDGER not honoured?)")


def _thread_group(name: str) -> str:
    """``hub-db_0`` -> ``hub-db``: a pool's threads as one row."""
    return re.sub(r"_\d+$", "", name)


def ledger_delta(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    """us of CPU per task: per stage, per thread (all, and not charged to any stage), the process."""
    per = 1e6 / max(1, n)
    stages = {}
    for name, (blocks, ns) in after["stages"].items():
        b0, ns0 = before["stages"].get(name, [0, 0])
        if blocks - b0 or ns - ns0:
            stages[name] = {"us_per_task": round((ns - ns0) / 1e3 / max(1, n), 2), "blocks": blocks - b0}
    threads: dict[str, dict[str, float]] = {}
    for name, cpu in after["threads"].items():
        g = _thread_group(name)
        row = threads.setdefault(g, {"cpu_us_per_task": 0.0, "in_stages_us_per_task": 0.0})
        row["cpu_us_per_task"] += (cpu - before["threads"].get(name, 0.0)) * per
    for name, s in after.get("charged_s", {}).items():
        g = _thread_group(name)
        row = threads.setdefault(g, {"cpu_us_per_task": 0.0, "in_stages_us_per_task": 0.0})
        row["in_stages_us_per_task"] += (s - before.get("charged_s", {}).get(name, 0.0)) * per
    for row in threads.values():
        row["unaccounted_us_per_task"] = round(row["cpu_us_per_task"] - row["in_stages_us_per_task"], 2)
        row["cpu_us_per_task"] = round(row["cpu_us_per_task"], 2)
        row["in_stages_us_per_task"] = round(row["in_stages_us_per_task"], 2)
    return {
        "process_cpu_us_per_task": round((after["process_cpu_s"] - before["process_cpu_s"]) * per, 2),
        "children_cpu_us_per_task": round((after.get("children_cpu_s", 0.0) - before.get("children_cpu_s", 0.0)) * per, 2),
        "stages": dict(sorted(stages.items(), key=lambda kv: -kv[1]["us_per_task"])),
        "threads": threads,
    }


def _self_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _tree_cpu() -> float:
    """This process and its live children (Parsl's interchange and worker pool)."""
    total = _self_cpu()
    for ch in psutil.Process().children(recursive=True):
        try:
            t = ch.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


# ---------------------------------------------------------------- phases
def batched(submit: Callable[[], Any], n: int) -> dict[str, Any]:
    deadline = time.monotonic() + PHASE_BUDGET_S
    t0 = time.perf_counter()
    futures = [submit() for _ in range(n)]
    done, failed = c.wait_all(futures, deadline)
    return {"tasks": n, "completed": done, "failed": failed, "wall_s": round(time.perf_counter() - t0, 3)}


def sequential(submit: Callable[[], Any], n: int) -> dict[str, Any]:
    deadline = time.monotonic() + PHASE_BUDGET_S
    t0 = time.perf_counter()
    done = failed = 0
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        try:
            submit().result(timeout=30)
        except Exception:
            failed += 1
        done += 1
    return {"tasks": n, "completed": done, "failed": failed, "wall_s": round(time.perf_counter() - t0, 3)}


def mesh_ledger(transport: str, n: int, m: int, warmup: int, workdir: str | None) -> dict[str, Any]:
    from cloud_hub.client import Executor

    folder = Path(tempfile.mkdtemp(prefix=f"bench-ledger-{transport}-"))
    old = os.environ.get("MESH_COST_LEDGER")
    os.environ["MESH_COST_LEDGER"] = str(folder)  # the hub and agent processes inherit it
    try:
        with c.local_mesh(transport, workers=2, workdir=workdir) as (mesh, agent):
            with Executor(mesh.client, agent.endpoint_id) as ex:
                if ex._stream is None:
                    raise RuntimeError("the hub offers no stream")
                c.log(f"mesh over {transport}: warm-up {warmup}")
                w = batched(lambda: ex.submit(noop), warmup)
                if w["completed"] < warmup or w["failed"]:
                    raise RuntimeError(f"warm-up over {transport} did not complete: {w}")
                out: dict[str, Any] = {}
                for phase, run, k in (("batched", batched, n), ("sequential", sequential, m)):
                    c.log(f"mesh over {transport}: {phase}, {k} no-op tasks")
                    before, sdk0 = fresh_ledgers(folder), _self_cpu()
                    r = run(lambda: ex.submit(noop), k)
                    sdk1 = _self_cpu()
                    after = fresh_ledgers(folder)
                    done = max(1, r["completed"])
                    r["hub"] = ledger_delta(before["hub"], after["hub"], done)
                    r["agent"] = ledger_delta(before["agent"], after["agent"], done)
                    r["sdk_cpu_us_per_task"] = round((sdk1 - sdk0) * 1e6 / done, 2)
                    r["total_cpu_us_per_task"] = round(r["hub"]["process_cpu_us_per_task"] + r["agent"]["process_cpu_us_per_task"]
                                                       + r["agent"]["children_cpu_us_per_task"] + r["sdk_cpu_us_per_task"], 2)
                    out[phase] = r
    finally:
        if old is None:
            os.environ.pop("MESH_COST_LEDGER", None)
        else:
            os.environ["MESH_COST_LEDGER"] = old
    out["agent_settings"] = {"transport": transport, "workers": 2, "prefetch": 256}
    return out


def parsl_cpu(n: int, m: int, warmup: int) -> dict[str, Any]:
    c.log(f"Parsl HTEX (2 local workers): warm-up {warmup}, then {n} batched and {m} sequential no-ops")
    out: dict[str, Any] = {"settings": c.PARSL_SETTINGS}
    with c.parsl_htex(2) as python_app:
        app = python_app(noop)
        app().result(timeout=120)  # the first task waits for the worker pool to start
        batched(app, warmup)
        for phase, run, k in (("batched", batched, n), ("sequential", sequential, m)):
            t0 = _tree_cpu()
            r = run(app, k)
            r["cpu_us_per_task"] = round((_tree_cpu() - t0) * 1e6 / max(1, r["completed"]), 2)
            out[phase] = r
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=5000, help="batched no-op tasks per system (default 5000)")
    p.add_argument("--seq", type=int, default=300, help="sequential round trips per system (default 300)")
    p.add_argument("--warmup", type=int, default=200, help="untimed tasks first (default 200)")
    c.add_common_args(p)
    args = p.parse_args()
    if args.quick:
        args.tasks, args.seq, args.warmup = min(args.tasks, 1000), min(args.seq, 100), min(args.warmup, 50)
    if c.smoke(args):
        args.tasks, args.seq, args.warmup = min(args.tasks, 60), min(args.seq, 10), min(args.warmup, 10)
        args.transports = args.transports.split(",")[0]
    started = time.monotonic()
    out = c.header("hotpath", args)
    mesh = {t: mesh_ledger(t, args.tasks, args.seq, args.warmup, args.workdir) for t in args.transports.split(",") if t}
    parsl = None if (args.no_parsl or c.SMOKE) else parsl_cpu(args.tasks, args.seq, args.warmup)
    if c.SMOKE and not args.no_parsl:
        out["parsl_htex"] = c.smoke_skipped("the Parsl baseline", "its worker pool takes seconds to start; the full run has it")
    else:
        out["parsl_htex"] = parsl
    out["mesh"] = mesh
    summary = {}
    for t, r in mesh.items():
        row = {}
        for phase in ("batched", "sequential"):
            hub_us = r[phase]["hub"]["process_cpu_us_per_task"]
            parsl_us = (parsl or {}).get(phase, {}).get("cpu_us_per_task")
            row[phase] = {"hub_cpu_us_per_task": hub_us, "agent_cpu_us_per_task": r[phase]["agent"]["process_cpu_us_per_task"],
                          "mesh_total_cpu_us_per_task": r[phase]["total_cpu_us_per_task"], "parsl_cpu_us_per_task": parsl_us,
                          "hub_vs_parsl": c.ratio(hub_us, parsl_us),
                          "mesh_total_vs_parsl": c.ratio(r[phase]["total_cpu_us_per_task"], parsl_us),
                          "target_hub_us": TARGETS[f"{phase}_hub_us"], "met": hub_us <= TARGETS[f"{phase}_hub_us"]}
        summary[t] = row
    out["summary"] = summary
    c.finish("hotpath", out, args, started)
    problems = [f"mesh {t} {ph}: {r[ph]['completed']} of {r[ph]['tasks']} done, {r[ph]['failed']} failed"
                for t, r in mesh.items() for ph in ("batched", "sequential") if r[ph]["completed"] < r[ph]["tasks"] or r[ph]["failed"]]
    for t, r in mesh.items():
        for ph in ("batched", "sequential"):
            for role in ("hub", "agent"):
                if not any(k.startswith(("hub.", "agent.", "db.")) for k in r[ph][role]["stages"]):
                    problems.append(f"mesh {t} {ph}: the {role}'s ledger has no stages")
    c.smoke_check(problems)


if __name__ == "__main__":
    main()
