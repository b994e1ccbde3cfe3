"""``./taskw demo``: a whole mesh on this machine running a real workload.

Starts Mosquitto, the hub (SQLite), three agent processes (two over MQTT, one over ZeroMQ),
then runs thousands of small calls and some numpy work on every endpoint through the SDK,
kills one agent in the middle to show that nothing is lost, and prints a summary table; lets
the scheduler place two waves (``endpoint="auto"``) and shows each endpoint's measured speed
next to its share; then runs the FL demo (``fl.demo``) on the same mesh. Run from a terminal,
the mesh then keeps serving (console link and token printed) until Ctrl-C; ``--no-serve``
exits at once, ``--serve`` serves even without a terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh

console = Console(width=None if Console().is_terminal else 120)


def monte_carlo_pi(samples: int, seed: int) -> float:
    """A small CPU-bound call: thousands of these make the workload."""
    import random

    rng = random.Random(seed)
    inside = sum(1 for _ in range(samples) if rng.random() ** 2 + rng.random() ** 2 <= 1.0)
    return 4.0 * inside / samples


def spectral_radius(n: int, seed: int) -> float:
    """Some numpy work: eigenvalues of a random symmetric matrix."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n))
    return float(np.max(np.abs(np.linalg.eigvalsh(a + a.T))))


def placed_pi(seed: int) -> float:
    """The scheduler's workload: a function of its own (no profile yet, so wave 1 explores), pure
    Python and long enough (~8 ms on a full core) that a CPU quota shows in every run."""
    return monte_carlo_pi(60000, seed)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _auto_placement(mesh: LocalMesh, agents: list[Any], n: int, speed: dict[str, str]) -> tuple[bool, dict[str, Any]]:
    """Let the scheduler place work (``endpoint="auto"``) in two waves: the first explores an
    unprofiled function, the second uses what it measured. The tables show what a reader needs to
    judge it: per endpoint what it is (workers, CPU), how fast it really ran the function, the
    share that would minimise the wave's makespan next to the share it got, and for wave 2 the
    predicted and actual completion times with the terms that drove the choice; per wave the
    makespan next to the ideal one. Returns (all tasks ok, the figures as a dict)."""
    if n <= 0:
        return True, {}
    ok = True
    size = n // 2
    names = {a.endpoint_id: a.cfg.name for a in agents}
    waves: list[dict[str, Any]] = []
    runs: list[dict[str, list[float]]] = []
    decisions: list[list[dict[str, Any]]] = []
    with Executor(mesh.client, endpoint="auto") as ex:
        for _wave in (1, 2):
            t0 = time.perf_counter()
            fs = [ex.submit(placed_pi, i) for i in range(size)]
            done, not_done = wait(fs, timeout=300)
            makespan = time.perf_counter() - t0  # first submit to last result, at the client
            ok = ok and not not_done and all(f.exception() is None for f in done)
            spans = {f.task_id: (getattr(f, "started", None), getattr(f, "finished", None)) for f in done}  # type: ignore[attr-defined]
            r: dict[str, list[float]] = {a.endpoint_id: [] for a in agents}
            for f in done:
                if getattr(f, "started", None) and getattr(f, "finished", None):
                    r.setdefault(f.endpoint_id, []).append(f.finished - f.started)  # type: ignore[attr-defined]
            runs.append(r)
            ids = {f.task_id for f in fs}  # type: ignore[attr-defined]
            rows = [d for d in mesh.client.scheduler_decisions(limit=max(50, size + 50))["decisions"]
                    if d["task_id"] in ids and d.get("actual_s") is not None and d.get("predicted_s") is not None]
            decisions.append(rows)
            tasks = [{"endpoint": names.get(d["endpoint_id"], d["endpoint_id"]), "placed_at": d["placed_at"],
                      "completed_at": d.get("completed_at"), "started": spans.get(d["task_id"], (None, None))[0],
                      "finished": spans.get(d["task_id"], (None, None))[1], "predicted": d["predicted"],
                      "actual_s": d["actual_s"]} for d in sorted(rows, key=lambda d: d["seq"])]
            waves.append({"tasks": size, "makespan_s": makespan,
                          "share": {e: sum(1 for f in fs if getattr(f, "endpoint_id", "") == e) / max(1, size) for e in names},
                          "task_rows": tasks})
    for k, w in enumerate(waves):
        # The makespan-minimising split, from this wave's measured run times (the other wave's for
        # an endpoint that ran nothing in it): each endpoint's throughput is workers / mean run.
        rate = {}
        for a in agents:
            rr = runs[k].get(a.endpoint_id) or runs[1 - k].get(a.endpoint_id) or []
            if rr:
                rate[a.endpoint_id] = a.cfg.workers / statistics.mean(rr)
        tot = sum(rate.values())
        w["mean_run_s"] = {e: statistics.mean(runs[k][e]) if runs[k].get(e) else None for e in names}
        w["ideal_share"] = {e: rate[e] / tot for e in rate} if tot else {}
        w["ideal_makespan_s"] = size / tot if tot else None
        w["makespan_vs_ideal"] = w["makespan_s"] / w["ideal_makespan_s"] if w["ideal_makespan_s"] else None
        rows = decisions[k]
        errs = [abs(d["actual_s"] - d["predicted_s"]) for d in rows]
        w["prediction_median_abs_error_s"] = _median(errs)
        w["actual_median_s"] = _median([d["actual_s"] for d in rows])
        w["prediction_error_vs_actual"] = (w["prediction_median_abs_error_s"] / w["actual_median_s"]
                                           if errs and w["actual_median_s"] else None)
        per: dict[str, Any] = {}
        for e in names:
            mine = [d for d in rows if d["endpoint_id"] == e]
            terms = {t: _median([d["predicted"].get(t, 0.0) for d in mine]) for t in ("transfer_in", "queue", "cold", "run", "transfer_out")}
            per[e] = {"tasks": len(mine), "predicted_median_s": _median([d["predicted_s"] for d in mine]),
                      "actual_median_s": _median([d["actual_s"] for d in mine]), "terms_median_s": terms}
        w["endpoints"] = per
        w["max_share_gap"] = max((abs(w["share"].get(e, 0.0) - v) for e, v in w["ideal_share"].items()), default=None)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    table = Table(title=f'Scheduler placement (endpoint="auto"): 2 waves of {size} tasks')
    for col in ("endpoint", "workers", "CPU", "mean run ms", "ideal share", "wave 1 share", "wave 2 share"):
        table.add_column(col, justify="left" if col in ("endpoint", "CPU") else "right")
    for a in agents:
        e = a.endpoint_id
        allr = runs[0].get(e, []) + runs[1].get(e, [])
        table.add_row(a.cfg.name, str(a.cfg.workers), speed.get(e, "full"),
                      f"{statistics.mean(allr) * 1e3:.1f}" if allr else "-",  # mean: a CPU quota shows as throttled runs
                      pct(waves[1]["ideal_share"].get(e)), pct(waves[0]["share"][e]), pct(waves[1]["share"][e]))
    console.print(table)
    why = Table(title="Wave 2, per endpoint: predicted vs actual completion (placement to result at the hub) and the "
                      "predicted terms, medians per task in ms")
    for col in ("endpoint", "tasks", "predicted", "actual", "link in", "queue", "cold", "run", "link out"):
        why.add_column(col, justify="left" if col == "endpoint" else "right")
    for a in agents:
        d = waves[1]["endpoints"][a.endpoint_id]
        t = d["terms_median_s"]
        why.add_row(a.cfg.name, str(d["tasks"]), ms(d["predicted_median_s"]), ms(d["actual_median_s"]),
                    ms(t["transfer_in"]), ms(t["queue"]), ms(t["cold"]), ms(t["run"]), ms(t["transfer_out"]))
    console.print(why)
    console.print("ideal share = workers / mean run, normalised: the split that minimises a wave's makespan; "
                  "ideal makespan = tasks / sum of (workers / mean run)")
    for k, w in enumerate(waves, 1):
        console.print(f"wave {k}: makespan {w['makespan_s']:.2f} s, ideal {w['ideal_makespan_s'] or float('nan'):.2f} s "
                      f"({w['makespan_vs_ideal'] or float('nan'):.2f}x); largest share gap {pct(w['max_share_gap'])} points; "
                      f"median |predicted - actual| {ms(w['prediction_median_abs_error_s'])} ms "
                      f"({pct(w['prediction_error_vs_actual'])} of the median actual {ms(w['actual_median_s'])} ms)")
    console.print("each decision, with the predictions it compared: GET /v1/scheduler/decisions; "
                  "what the scheduler believes per endpoint: GET /v1/scheduler/state")
    return ok, {"waves": [{**w, "share": {names[e]: v for e, v in w["share"].items()},
                           "ideal_share": {names[e]: v for e, v in w["ideal_share"].items()},
                           "mean_run_s": {names[e]: v for e, v in w["mean_run_s"].items()},
                           "endpoints": {names[e]: v for e, v in w["endpoints"].items()}} for w in waves],
                "workers": {a.cfg.name: a.cfg.workers for a in agents}}


def _scheduler_state(mesh: LocalMesh) -> Any:
    """GET /v1/scheduler/state: what the scheduler believes per endpoint (links, clock offsets,
    throughput, cold starts, calibration), for the JSON figures."""
    import httpx

    try:
        r = httpx.get(f"{mesh.url}/v1/scheduler/state", headers={"Authorization": f"Bearer {mesh.token}"},
                      timeout=30, verify=False)
        return r.json() if r.status_code == 200 else {"status": r.status_code}
    except httpx.HTTPError as exc:
        return {"error": str(exc)}


def _slow_device(mesh: LocalMesh, name: str, speed: dict[str, str]) -> tuple[Any, Any]:
    """Start ``name`` as a Raspberry Pi Zero 2 W would run it: one core at a quarter of its time,
    in a cgroup (the simulator's device profile, docs/simulator.md). Where cgroups cannot be used
    here it runs at full speed, and the demo says why. Returns the agent and its cgroups."""
    from sim.emulate.constrain import CgroupRun, ConstrainedAgent, Unavailable
    from sim.emulate.devices import profile

    base = mesh.add_agent(name, "mqtt", workers=1, start=False)
    prof = profile("pi-zero-2w")
    try:
        cgroups = CgroupRun(f"mesh-demo-{os.getpid()}").probe()
        slow = ConstrainedAgent(base, cgroups.add(name, prof, slot=0), {})
    except (Unavailable, OSError) as exc:
        console.print(f"[yellow]{name} runs at full speed: cannot emulate a slow device here ({exc})[/yellow]")
        return base.start(), None
    mesh.agents[mesh.agents.index(base)] = slow
    speed[base.endpoint_id] = f"{prof.cpu_quota:.0%} of 1 core (a Pi Zero 2 W)"
    return slow.start(), cgroups


def _serve_until_interrupted(mesh: LocalMesh) -> None:
    """Keep hub, broker and agents up so the console link printed above works; Ctrl-C ends it."""
    # soft_wrap: a link and a token broken over two lines cannot be copied
    console.print(f"[bold]serving[/bold]: console {mesh.url}/console (token {mesh.token}); "
                  "the mesh stays up until Ctrl-C", soft_wrap=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping the mesh")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=3000, help="small calls per endpoint")
    ap.add_argument("--matrices", type=int, default=20, help="numpy tasks per endpoint")
    ap.add_argument("--auto", type=int, default=300, help="tasks placed by the scheduler (endpoint='auto')")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    ap.add_argument("--no-kill", action="store_true", help="do not SIGKILL an agent mid-run")
    ap.add_argument("--tls", action="store_true", help="HTTPS hub, MQTT agents over TLS (certificates from `mesh-hub tls init`, CA pinned at enrollment)")
    ap.add_argument("--fl-rounds", type=int, default=12, help="rounds of the FL demo on the same mesh (0: no FL)")
    ap.add_argument("--json", metavar="PATH", help="write the placement figures (both waves, per endpoint) and the "
                    "scheduler's state after them to PATH as JSON (bench/scheduler.py reads it)")
    ap.add_argument("--serve", action=argparse.BooleanOptionalAction, default=None,
                    help="keep the mesh (and its console) up until Ctrl-C; default: yes when run from a terminal")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # One BLAS thread per worker (the agents inherit this): four workers on a small machine each
    # starting a thread per core would make the numpy tasks fight over the cores.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    serve = args.serve if args.serve is not None else sys.stdin.isatty() and sys.stdout.isatty()
    workdir = Path(tempfile.mkdtemp(prefix="continuum-demo-"))
    console.print(f"[bold]Continuum Mesh demo[/bold] in {workdir}")
    try:
        with LocalMesh(workdir, heartbeat_s=1.0, lost_after_s=4.0, tls=args.tls) as mesh:
            console.print(f"hub {mesh.url}, mosquitto 127.0.0.1:{mesh.broker.port}, ZeroMQ {mesh.hub.hub.zmq_address}")  # type: ignore[union-attr]
            if args.tls:
                console.print(f"TLS: MQTT agents use mqtts://127.0.0.1:{mesh.broker.tls_port}, CA pinned at enrollment by {mesh.tls_files.ca_hash}")  # type: ignore[union-attr]
            # Visibly different endpoints, so the scheduler's choices can be judged: a slow field
            # device (a Pi Zero 2 W's CPU, emulated with a cgroup quota), a full-speed one, and a
            # two-worker login node.
            speed: dict[str, str] = {}
            slow, cgroups = _slow_device(mesh, "pi-field-1", speed)
            agents = [slow, mesh.add_agent("pi-field-2", "mqtt", workers=1), mesh.add_agent("hpc-login", "zmq", workers=2)]
            mesh.wait_online(timeout=60)
            console.print("three agents online: " + ", ".join(f"{a.cfg.name} ({a.cfg.transport})" for a in agents))
            t0 = time.perf_counter()
            futures: dict[str, list[Future[Any]]] = {}
            executors = {a.endpoint_id: Executor(mesh.client, a.endpoint_id) for a in agents}
            for a in agents:
                ex = executors[a.endpoint_id]
                fs = [ex.submit(monte_carlo_pi, 2000, i) for i in range(args.calls)]
                fs += [ex.submit(spectral_radius, 200, i) for i in range(args.matrices)]
                futures[a.endpoint_id] = fs
            total = sum(len(v) for v in futures.values())
            console.print(f"submitted {total} tasks")
            if not args.no_kill:
                victim = agents[0]
                while sum(f.done() for f in futures[victim.endpoint_id]) < len(futures[victim.endpoint_id]) // 3:
                    time.sleep(0.05)
                victim.kill()
                console.print(f"[yellow]SIGKILLed {victim.cfg.name} mid-run (a power cut); restarting it[/yellow]")
                time.sleep(0.5)
                victim.start()
            all_fs = [f for fs in futures.values() for f in fs]
            with console.status("waiting for results"):
                done, not_done = wait(all_fs, timeout=600)
            elapsed = time.perf_counter() - t0
            for ex in executors.values():
                ex.shutdown(wait=False)
            table = Table(title=f"{total} tasks in {elapsed:.1f}s ({total / elapsed:.0f} tasks/s)")
            for col in ("endpoint", "transport", "tasks", "ok", "failed", "mean run ms", "pi estimate", "mean spectral radius"):
                table.add_column(col, justify="right" if col not in ("endpoint", "transport") else "left")
            for a in agents:
                fs = futures[a.endpoint_id]
                ok = [f for f in fs if f.done() and f.exception() is None]
                runs = [(f.finished - f.started) * 1e3 for f in ok if getattr(f, "started", None) and getattr(f, "finished", None)]  # type: ignore[attr-defined]
                pis = [f.result() for f in fs[: args.calls] if f.done() and f.exception() is None]
                radii = [f.result() for f in fs[args.calls :] if f.done() and f.exception() is None]
                table.add_row(
                    a.cfg.name, a.cfg.transport, str(len(fs)), str(len(ok)), str(len(fs) - len(ok)),
                    f"{statistics.mean(runs):.2f}" if runs else "-",
                    f"{statistics.mean(pis):.4f}" if pis else "-",
                    f"{statistics.mean(radii):.1f}" if radii else "-",
                )
            console.print(table)
            lost = len(not_done)
            console.print(f"lost: {lost}, results delivered: {len(done)} of {total}")
            auto_ok, figures = _auto_placement(mesh, agents, args.auto, speed)
            if args.json:
                figures["flood"] = {"tasks": total, "elapsed_s": elapsed, "lost": lost, "killed": not args.no_kill}
                figures["scheduler_state"] = _scheduler_state(mesh)
                Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
            console.print(f"console: {mesh.url}/console (sign in with token {mesh.token})", soft_wrap=True)
            fl_rc = 0
            if args.fl_rounds > 0:
                from fl.demo import run as run_fl

                fl_rc = run_fl(mesh, rounds=args.fl_rounds, kill=not args.no_kill)
            rc = 0 if lost == 0 and auto_ok and fl_rc == 0 and all(f.exception() is None for f in done) else 1
            if serve:
                _serve_until_interrupted(mesh)
            mesh.stop()
            if cgroups is not None:
                cgroups.remove()
            return rc
    except KeyboardInterrupt:
        console.print("interrupted; everything stopped")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
