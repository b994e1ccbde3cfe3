"""Scheduler benchmark: every policy on the shipped DES scenarios, plus the 1,000 x 1,000,000 run.

Prints one JSON document and writes it to ``bench/results/scheduler-<date>.json``.

* ``heterogeneous``, ``bursty``, ``rural-outages``: makespan and completion times per policy,
  including ``oracle`` (earliest-finish list scheduling with the simulator's true run times;
  not deployable, a yardstick) and the ratios the design targets refer to.
* ``scale``: wall time of the delta policy on 1,000 endpoints x 1,000,000 tasks.

Usage: ``python bench/scheduler.py [--quick] [--smoke] [--skip-scale] [--scale-only]``
(``--quick`` runs each scenario with a tenth of its tasks and skips the scale run; ``--smoke``
runs everything at a hundredth of its size and writes no file).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path and this module would shadow the
# `scheduler` package it benchmarks: drop the folder and put the repository root first.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != Path(_HERE)]
sys.path.insert(0, str(ROOT))

from sim.des import Simulation, load_scenario, run_scenario  # noqa: E402

SCENARIOS = ROOT / "sim" / "scenarios"
KEYS = ("makespan_s", "completion_mean_s", "completion_p50_s", "completion_p99_s",
        "prediction_mean_rel_error", "wall_s")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def policy_runs(quick: bool, smoke: bool = False) -> dict:
    out = {}
    for name in ("heterogeneous", "bursty", "rural-outages"):
        sc = load_scenario(SCENARIOS / f"des-{name}.yaml")
        if quick or smoke:
            d = sc.model_dump()
            d["workload"]["tasks"] = max(d["workload"]["tasks"] // (100 if smoke else 10), 100)
            sc = load_scenario(d)
        t0 = time.perf_counter()
        rep = run_scenario(sc)
        res = rep["results"]
        out[name] = {
            "endpoints": rep["endpoints"],
            "tasks": rep["tasks"],
            "seed": rep["seed"],
            "wall_s": round(time.perf_counter() - t0, 2),
            "policies": {p: {k: round(m[k], 4) for k in KEYS} | {"tasks_per_class": m["tasks_per_class"]}
                         for p, m in res.items()},
        }
        d = res["delta"]["makespan_s"]
        out[name]["ratios"] = {
            "delta_vs_round_robin_makespan": _ratio(d, res["round-robin"]["makespan_s"]),
            "delta_vs_fastest_endpoint_makespan": _ratio(d, res["fastest-endpoint"]["makespan_s"]),
            "delta_vs_oracle_makespan": _ratio(d, res["oracle"]["makespan_s"]),
            "outage_aware_vs_delta_makespan": _ratio(res["delta-outage-aware"]["makespan_s"], d),
            "outage_aware_vs_delta_mean_completion": _ratio(
                res["delta-outage-aware"]["completion_mean_s"], res["delta"]["completion_mean_s"]),
            "outage_aware_vs_delta_p99_completion": _ratio(
                res["delta-outage-aware"]["completion_p99_s"], res["delta"]["completion_p99_s"]),
        }
    return out


def scale_run(smoke: bool = False) -> dict:
    sc = load_scenario(SCENARIOS / "des-scale.yaml")
    if smoke:  # the same run at a hundredth of the fleet and a five-hundredth of the tasks
        d = sc.model_dump()
        for e in d["endpoints"]:
            e["count"] = max(1, e["count"] // 100)
        d["workload"]["tasks"] = 2000
        sc = load_scenario(d)
    t0 = time.perf_counter()
    c0 = time.process_time()
    sim = Simulation(sc, "delta")
    t1 = time.perf_counter()
    r = sim.run()
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return {
        "endpoints": r["endpoints"],
        "tasks": r["tasks"],
        "policy": "delta",
        "event_loop_wall_s": round(r["wall_s"], 2),
        "setup_wall_s": round(t1 - t0, 2),  # workload generation and fleet construction
        "total_wall_s": round(total, 2),
        # CPU time of this process: on a shared VM the wall time also counts other processes
        "total_cpu_s": round(cpu, 2),
        "events": r["events"],
        "makespan_s": round(r["makespan_s"], 1),
        "completion_mean_s": round(r["completion_mean_s"], 3),
        "completion_p99_s": round(r["completion_p99_s"], 3),
        "target_total_wall_s": 60,
        "met": total <= 60,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the tasks, no scale run")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--scale-only", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: each scenario with a hundredth of its tasks and the scale run at a hundredth of its "
                         "fleet and 2,000 tasks; prints the JSON, writes nothing under bench/results/")
    args = ap.parse_args()
    report: dict = {
        "benchmark": "scheduler",
        "date": dt.date.today().isoformat(),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "quick": args.quick,
        "smoke": args.smoke,
    }
    # The timed scale run goes first, on a machine not yet busy with the policy runs.
    if args.smoke or not (args.quick or args.skip_scale):
        report["scale"] = scale_run(args.smoke)
        report["machine"]["loadavg_after_scale"] = [round(x, 2) for x in os.getloadavg()]
    if not args.scale_only:
        report["scenarios"] = policy_runs(args.quick, args.smoke)
    text = json.dumps(report, indent=2)
    print(text)
    if args.smoke:
        return
    out = ROOT / "bench" / "results" / f"scheduler-{report['date']}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
