"""No-op throughput: N tasks through hub + one agent with 2 workers, per transport, next to
Parsl HighThroughputExecutor with 2 local workers, measured in the same run.

Mesh: a LocalMesh (real Mosquitto, hub thread, one agent process, 2 workers) per transport;
``Executor.submit(noop)`` N times, then every future waited for. Parsl: ``noop()`` N times
through the DFK, then every future waited for. Both after a short warm-up; the clock runs from
the first submit to the last result.

The mesh runs through the SDK's stream (the default) and then, on the same mesh, through REST
(``Executor(stream=False)``), so the stream's gain is measured in the same run.

Target (issue 13): mesh tasks/s >= 10x Parsl HTEX tasks/s, one agent. One JSON object goes to stdout and to
bench/results/throughput-<UTC>.json; progress goes to stderr.

    python bench/throughput.py [--tasks 10000] [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import _common as c

TARGET_RATIO = 10.0  # mesh tasks/s >= 10x Parsl HTEX tasks/s (issue 13)
PHASE_BUDGET_S = 60.0  # time cap for one measured batch (submit + all results)


def noop() -> None:
    return None


def run_batch(submit: Callable[[], Any], n: int, budget_s: float) -> dict[str, Any]:
    """Submit ``n`` tasks, then wait for all of them; bounded by ``budget_s``."""
    deadline = time.monotonic() + budget_s
    t0 = time.perf_counter()
    futures = []
    for _ in range(n):
        futures.append(submit())
        if len(futures) % 1000 == 0 and time.monotonic() > deadline:
            break
    t_submitted = time.perf_counter()
    done, failed = c.wait_all(futures, deadline)
    t1 = time.perf_counter()
    for f in futures[done:]:
        f.cancel()
    elapsed = t1 - t0
    return {
        "tasks": n,
        "completed": done,
        "failed": failed,
        "timed_out": done < n,
        "submit_s": round(t_submitted - t0, 3),
        "total_s": round(elapsed, 3),
        "tasks_per_s": round(done / elapsed, 1) if elapsed > 0 else None,
    }


def mesh_throughput(transport: str, n: int, warmup: int, workdir: str | None) -> dict[str, Any]:
    from cloud_hub.client import Executor

    with c.local_mesh(transport, workers=2, workdir=workdir) as (mesh, agent):
        with Executor(mesh.client, agent.endpoint_id) as ex:
            if ex._stream is None:
                raise RuntimeError("the hub offers no stream")
            c.log(f"mesh over {transport}: warm-up {warmup} tasks")
            w = run_batch(lambda: ex.submit(noop), warmup, PHASE_BUDGET_S)
            if w["timed_out"] or w["failed"]:
                raise RuntimeError(f"warm-up over {transport} did not complete: {w}")
            c.log(f"mesh over {transport}: {n} no-op tasks through the SDK stream")
            out = run_batch(lambda: ex.submit(noop), n, PHASE_BUDGET_S)
            stats = mesh.hub.hub.dispatcher.stats if mesh.hub is not None else {}
        with Executor(mesh.client, agent.endpoint_id, stream=False) as ex:
            c.log(f"mesh over {transport}: {n} no-op tasks through REST")
            run_batch(lambda: ex.submit(noop), warmup, PHASE_BUDGET_S)
            out["rest"] = run_batch(lambda: ex.submit(noop), n, PHASE_BUDGET_S)
    out["agent"] = {"transport": transport, "workers": 2, "prefetch": 256}
    out["hub_stats"] = dict(stats)
    return out


def parsl_throughput(n: int, warmup: int) -> dict[str, Any]:
    c.log(f"Parsl HTEX (2 local workers): warm-up {warmup}, then {n} no-op tasks")
    with c.parsl_htex(2) as python_app:
        app = python_app(noop)
        app().result(timeout=120)  # the first task waits for the worker pool to start
        w = run_batch(app, warmup, PHASE_BUDGET_S)
        if w["timed_out"] or w["failed"]:
            raise RuntimeError(f"Parsl warm-up did not complete: {w}")
        out = run_batch(app, n, PHASE_BUDGET_S)
    out["settings"] = c.PARSL_SETTINGS
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="no-op tasks per system (default 10000)")
    p.add_argument("--warmup", type=int, default=200, help="untimed tasks first (default 200)")
    p.add_argument("--samples", type=int, default=None, help="alias of --tasks, for symmetry with latency.py")
    c.add_common_args(p)
    args = p.parse_args()
    if args.samples is not None:
        args.tasks = args.samples
    if args.quick:
        args.tasks, args.warmup = min(args.tasks, 500), min(args.warmup, 50)
    if c.smoke(args):
        args.tasks, args.warmup = min(args.tasks, 50), min(args.warmup, 10)
    started = time.monotonic()
    out = c.header("throughput", args)
    mesh = {t: mesh_throughput(t, args.tasks, args.warmup, args.workdir) for t in args.transports.split(",") if t}
    parsl = None if args.no_parsl else parsl_throughput(args.tasks, args.warmup)
    out["mesh"] = mesh
    out["parsl_htex"] = parsl
    targets = {}
    for t, r in mesh.items():
        x = c.ratio(r.get("tasks_per_s"), (parsl or {}).get("tasks_per_s"))
        targets[t] = {
            "target": f"mesh tasks/s >= {TARGET_RATIO:g}x Parsl HTEX tasks/s",
            "mesh_tasks_per_s": r.get("tasks_per_s"),
            "parsl_tasks_per_s": (parsl or {}).get("tasks_per_s"),
            "ratio_vs_parsl": x,
            "met": None if x is None else (x >= TARGET_RATIO and not r["timed_out"]),
            "rest_tasks_per_s": r["rest"].get("tasks_per_s"),
            "rest_ratio_vs_parsl": c.ratio(r["rest"].get("tasks_per_s"), (parsl or {}).get("tasks_per_s")),
        }
    out["targets"] = targets
    c.finish("throughput", out, args, started)
    batches = {f"mesh {t}": r for t, r in mesh.items()} | {f"mesh {t} rest": r["rest"] for t, r in mesh.items()}
    if parsl is not None:
        batches["parsl"] = parsl
    c.smoke_check([f"{k}: {b['completed']} of {b['tasks']} done, {b['failed']} failed" for k, b in batches.items()
                   if b["timed_out"] or b["failed"]])


if __name__ == "__main__":
    main()
