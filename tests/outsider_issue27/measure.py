"""Outsider measurement of issue 27's "under load" promises on real processes.

Scenario (deliberately not the demo's):

* a LocalMesh (Mosquitto, in-process hub on SQLite) with three agents of 1 / 2 / 3 workers,
  ``ox-one`` (MQTT), ``ox-two`` (ZeroMQ), ``ox-three`` (MQTT);
* a wave function whose run time depends on the endpoint that runs it (it reads
  ``MESH_ENDPOINT_NAME`` and sleeps 30 / 45 / 120 ms), so the throughputs are 33 / 44 / 25
  tasks/s and the makespan-minimising shares about 32 / 43 / 24 %;
* a flood of no-op tasks to NAMED endpoints (``--flood`` per endpoint), with ``ox-two`` SIGKILLed
  when a third of its flood is done and restarted ``--down`` seconds later;
* right after the flood, ``--waves`` waves of ``--wave`` ``endpoint="auto"`` tasks (wave 1 is the
  first call of the function anywhere: exploration);
* a drift wave: the same, plus ``--named`` tasks NAMED to ``ox-two``; once 15 % of the wave's
  results are in, a flag file makes ``ox-two`` run the function ``--drift`` x slower, which the
  scheduler does not know. Late binding should move tasks still waiting in the hub for it.

Per wave: makespan (first submit to last result at the client) against the ideal makespan
(tasks / sum over endpoints of workers / mean measured run time there, run time =
``future.finished - future.started``, endpoint = ``future.endpoint_id`` after the result), the
shares against the ideal shares, and the median |predicted - actual| of the wave's decisions
(GET /v1/scheduler/decisions) against the median actual. Plus GET /v1/scheduler/state sampled
during and after the flood (latency, hub lag, calibration).

``python tests/outsider_issue27/measure.py --runs 3`` (waits, bounded, for a 1-min load average
below 1.5 before each run; prints a JSON line per run and a summary table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cloud_hub.client import Executor  # noqa: E402
from cloud_hub.localmesh import LocalMesh  # noqa: E402

# name -> (transport, workers, sleep per call in s)
AGENTS: dict[str, tuple[str, int, float]] = {
    "ox-one": ("mqtt", 1, 0.030),
    "ox-two": ("zmq", 2, 0.045),
    "ox-three": ("mqtt", 3, 0.120),
}
VICTIM = "ox-two"   # SIGKILLed mid-flood
DRIFTER = "ox-two"  # slows down mid-wave in the drift case


def flood_noop(i: int) -> int:
    """The flood: a no-op to a named endpoint."""
    return i


def wave_task(wave: str, seq: int, log_path: str, flag_path: str, drifter: str, factor: float, busy: bool = False,
              table: tuple = tuple((k, v[2]) for k, v in AGENTS.items())) -> str:
    """The placed work: its run time depends on where it runs; in the drift case, once the flag
    file exists, ``drifter`` runs it ``factor`` x slower. Appends one line per execution to
    ``log_path`` (O_APPEND, one short write: atomic), so runs can be counted. ``busy``: burn that
    much CPU time (``time.process_time``) instead of sleeping, so run times grow with contention."""
    import os
    import time

    name = os.environ.get("MESH_ENDPOINT_NAME", "?")
    s = dict(table).get(name, 0.05)
    if name == drifter and flag_path and os.path.exists(flag_path):
        s *= factor
    if busy:
        c0 = time.process_time()
        while time.process_time() - c0 < s:
            pass
    else:
        time.sleep(s)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{wave} {seq} {name} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return name


# ---------------------------------------------------------------------------- helpers
def wait_for_quiet(limit: float = 1.5, max_wait_s: float = 300.0, log: Callable[[str], None] = print) -> float:
    """Wait (bounded) for a 1-min load average below ``limit``; return the load at the end."""
    deadline = time.monotonic() + max_wait_s
    la = os.getloadavg()[0]
    while la >= limit and time.monotonic() < deadline:
        time.sleep(5)
        la = os.getloadavg()[0]
    if la >= limit:
        log(f"load average still {la:.2f} after {max_wait_s:.0f} s: measuring anyway")
    return la


def scheduler_state(mesh: LocalMesh) -> dict[str, Any]:
    return dict(mesh.client.request("GET", "/v1/scheduler/state"))


def all_decisions(mesh: LocalMesh, task_ids: set[str], max_pages: int = 20) -> dict[str, list[dict[str, Any]]]:
    """Every decision (newest first) for ``task_ids``, by task id, paging back with ``before``."""
    out: dict[str, list[dict[str, Any]]] = {}
    before = None
    for _ in range(max_pages):
        page = mesh.client.scheduler_decisions(limit=1000, before=before)
        for d in page["decisions"]:
            if d["task_id"] in task_ids:
                out.setdefault(d["task_id"], []).append(d)
        before = page.get("next_before")
        if before is None:
            break
    return out


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class Wave:
    """One wave's futures, with the client-side completion time of each."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.futures: list[Future[Any]] = []
        self.named: list[Future[Any]] = []
        self.done_at: dict[int, float] = {}
        self.t0 = 0.0
        self._lock = threading.Lock()

    def track(self, f: Future[Any]) -> Future[Any]:
        def cb(fut: Future[Any]) -> None:
            with self._lock:
                self.done_at[id(fut)] = time.perf_counter()
        f.add_done_callback(cb)
        return f


def run_wave(mesh: LocalMesh, ex: Executor, name: str, size: int, log_path: Path, *, named_ex: Executor | None = None,
             n_named: int = 0, flag: Path | None = None, factor: float = 1.0, drift_after: float = 0.15,
             timeout: float = 180.0, busy: bool = False) -> Wave:
    w = Wave(name)
    w.t0 = time.perf_counter()
    for i in range(n_named):  # named tasks first: they join the drifter's queue before the auto ones are placed
        assert named_ex is not None
        w.named.append(w.track(named_ex.submit(wave_task, f"{name}-named", i, str(log_path), str(flag or ""), DRIFTER, factor, busy)))
    for i in range(size):
        w.futures.append(w.track(ex.submit(wave_task, name, i, str(log_path), str(flag or ""), DRIFTER, factor, busy)))
    if flag is not None:
        deadline = time.monotonic() + timeout
        while sum(f.done() for f in w.futures) < drift_after * size and time.monotonic() < deadline:
            time.sleep(0.005)
        flag.touch()
        w.flag_at = time.perf_counter() - w.t0  # type: ignore[attr-defined]
    done, not_done = wait(w.futures + w.named, timeout=timeout)
    if flag is not None and flag.exists():
        flag.unlink()
    w.not_done = len(not_done)  # type: ignore[attr-defined]
    return w


def wave_figures(mesh: LocalMesh, w: Wave, workers: dict[str, int], names: dict[str, str],
                 fallback_run: dict[str, float]) -> dict[str, Any]:
    """Makespan vs ideal, shares vs ideal shares, prediction error, for one wave."""
    fs = [f for f in w.futures if f.done() and f.exception() is None]
    ends = [w.done_at[id(f)] for f in w.futures if id(f) in w.done_at]
    makespan = (max(ends) - w.t0) if ends and len(ends) == len(w.futures) else None
    runs: dict[str, list[float]] = {e: [] for e in names}
    where: dict[str, int] = {e: 0 for e in names}
    for f in fs:
        e = f.endpoint_id  # type: ignore[attr-defined]
        where[e] = where.get(e, 0) + 1
        if getattr(f, "started", None) is not None and getattr(f, "finished", None) is not None:
            runs.setdefault(e, []).append(f.finished - f.started)  # type: ignore[attr-defined]
    mean_run = {e: (statistics.mean(r) if r else fallback_run.get(e)) for e, r in runs.items()}
    rate = {e: workers[e] / m for e, m in mean_run.items() if m}
    tot = sum(rate.values())
    ideal = len(w.futures) / tot if tot else None
    ideal_share = {e: rate[e] / tot for e in rate} if tot else {}
    share = {e: where.get(e, 0) / max(1, len(w.futures)) for e in names}
    gap = max((abs(share.get(e, 0.0) - v) for e, v in ideal_share.items()), default=None)
    ids = {f.task_id for f in w.futures}  # type: ignore[attr-defined]
    decs = all_decisions(mesh, ids)
    w.decisions = decs  # type: ignore[attr-defined]
    final = [ds[0] for ds in decs.values() if ds and ds[0].get("actual_s") is not None and ds[0].get("predicted_s") is not None]
    errs = [abs(d["actual_s"] - d["predicted_s"]) for d in final]
    signed = [d["actual_s"] - d["predicted_s"] for d in final]
    med_err, med_act = _median(errs), _median([d["actual_s"] for d in final])
    moved = sum(1 for ds in decs.values() for d in ds if d["state"] == "moved")
    return {
        "wave": w.name, "tasks": len(w.futures), "ok": len(fs), "not_done": getattr(w, "not_done", None),
        "makespan_s": makespan, "ideal_makespan_s": ideal,
        "makespan_vs_ideal": (makespan / ideal) if makespan and ideal else None,
        "mean_run_ms": {names[e]: (m * 1e3 if m else None) for e, m in mean_run.items()},
        "share": {names[e]: round(v, 3) for e, v in share.items()},
        "ideal_share": {names[e]: round(v, 3) for e, v in ideal_share.items()},
        "max_share_gap_points": gap * 100 if gap is not None else None,
        "decisions_with_actual": len(final),
        "median_abs_error_s": med_err, "median_actual_s": med_act,
        "median_signed_error_s": _median(signed),
        "median_error_vs_actual": (med_err / med_act) if med_err is not None and med_act else None,
        "moved_decisions": moved,
        "flag_at_s": getattr(w, "flag_at", None),
    }


# ---------------------------------------------------------------------------- the scenario
def run_scenario(workdir: Path, *, flood_per_ep: int = 1500, wave: int = 240, waves: int = 3, drift: bool = True,
                 n_named: int = 24, drift_factor: float = 6.0, down_s: float = 1.0, heartbeat_s: float = 1.0,
                 lost_after_s: float = 4.0, log: Callable[[str], None] = print, hub_overrides: dict[str, Any] | None = None,
                 busy: bool = False,
                 inspect: Callable[[LocalMesh, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the whole scenario once; return the figures and the raw evidence (``raw``) for checks.
    ``inspect(mesh, out)`` is called at the end with the mesh still up."""
    out: dict[str, Any] = {"params": {"flood_per_endpoint": flood_per_ep, "wave": wave, "waves": waves, "drift": drift,
                                      "named": n_named, "drift_factor": drift_factor, "down_s": down_s, "busy": busy,
                                      "agents": {k: {"transport": t, "workers": n, "sleep_ms": s * 1e3} for k, (t, n, s) in AGENTS.items()}},
                           "load_at_start": os.getloadavg()[0]}
    raw: dict[str, Any] = {}
    out["raw"] = raw
    log_path = workdir / "task-runs.log"
    flag = workdir / "drift.flag"
    with LocalMesh(workdir / "mesh", heartbeat_s=heartbeat_s, lost_after_s=lost_after_s, hub_overrides=hub_overrides) as mesh:
        agents = {name: mesh.add_agent(name, t, workers=n) for name, (t, n, _s) in AGENTS.items()}
        mesh.wait_online(timeout=90)
        names = {a.endpoint_id: n for n, a in agents.items()}
        raw["endpoint_ids"] = {n: a.endpoint_id for n, a in agents.items()}
        workers = {a.endpoint_id: a.cfg.workers for a in agents.values()}
        log(f"agents online: {', '.join(f'{n} ({a.endpoint_id}, {a.cfg.workers} w)' for n, a in agents.items())}")

        raw["state_before_flood"] = scheduler_state(mesh)

        # ------------------------------------------------------------ flood with a SIGKILL
        t0 = time.perf_counter()
        samples: list[dict[str, Any]] = []
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                try:
                    st = scheduler_state(mesh)
                    samples.append({"t": time.perf_counter() - t0, "endpoints": {
                        names.get(e["endpoint_id"], e["endpoint_id"]): {"latency_s": e.get("latency_s"), "hub_lag_s": e.get("hub_lag_s")}
                        for e in st["endpoints"]}})
                except Exception as exc:  # noqa: BLE001 - evidence only
                    samples.append({"t": time.perf_counter() - t0, "error": repr(exc)})
                stop.wait(1.0)

        th = threading.Thread(target=sampler, daemon=True)
        flood: dict[str, list[Future[Any]]] = {}
        execs = {e: Executor(mesh.client, e) for e in names}
        for e, ex in execs.items():
            flood[e] = [ex.submit(flood_noop, i) for i in range(flood_per_ep)]
        th.start()
        victim = agents[VICTIM]
        vf = flood[victim.endpoint_id]
        deadline = time.monotonic() + 240
        while sum(f.done() for f in vf) < len(vf) // 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        done_at_kill = sum(f.done() for f in vf)
        victim.kill()
        kill_t = time.perf_counter() - t0
        log(f"SIGKILLed {VICTIM} at {kill_t:.1f} s ({done_at_kill}/{len(vf)} of its flood done); restart in {down_s} s")
        time.sleep(down_s)
        victim.start()
        allf = [f for fs in flood.values() for f in fs]
        done, not_done = wait(allf, timeout=300)
        flood_s = time.perf_counter() - t0
        stop.set()
        th.join(5)
        for ex in execs.values():
            ex.shutdown(wait=False)
        out["flood"] = {"tasks": len(allf), "elapsed_s": flood_s, "not_done": len(not_done),
                        "failed": sum(1 for f in done if f.exception() is not None), "kill_at_s": kill_t,
                        "victim_done_at_kill": done_at_kill}
        log(f"flood: {len(allf)} tasks in {flood_s:.1f} s, not done {len(not_done)}")
        raw["state_samples_during_flood"] = samples
        raw["state_after_flood"] = scheduler_state(mesh)

        # ------------------------------------------------------------ the waves
        out["waves"] = []
        raw["waves"] = []
        fallback = {a.endpoint_id: AGENTS[n][2] for n, a in agents.items()}
        with Executor(mesh.client, endpoint="auto") as ex:
            for k in range(1, waves + 1):
                la = os.getloadavg()[0]
                w = run_wave(mesh, ex, f"w{k}", wave, log_path, busy=busy)
                fig = wave_figures(mesh, w, workers, names, fallback)
                fig["load_before"] = la
                out["waves"].append(fig)
                raw["waves"].append(w)
                log(f"wave {k}: makespan {fmt(fig['makespan_s'])} s vs ideal {fmt(fig['ideal_makespan_s'])} s "
                    f"({fmt(fig['makespan_vs_ideal'])}x), share gap {fmt(fig['max_share_gap_points'], '.1f')} pts, "
                    f"median err {fmt(fig['median_error_vs_actual'], '.0%')} of actual, load {la:.2f}, shares {fig['share']} "
                    f"ideal {fig['ideal_share']}, not done {fig['not_done']}, ok {fig['ok']}, moved {fig['moved_decisions']}")
            raw["state_after_waves"] = scheduler_state(mesh)
            if drift:
                with Executor(mesh.client, agents[DRIFTER].endpoint_id) as nex:
                    before = mesh.client.scheduler_decisions(limit=1)["summary"]
                    la = os.getloadavg()[0]
                    w = run_wave(mesh, ex, "drift", wave, log_path, named_ex=nex, n_named=n_named, flag=flag, factor=drift_factor, busy=busy)
                    fig = wave_figures(mesh, w, workers, names, fallback)
                    fig["load_before"] = la
                    after = mesh.client.scheduler_decisions(limit=1)["summary"]
                    fig["summary_moved_before"], fig["summary_moved_after"] = before.get("moved"), after.get("moved")
                    out["drift"] = fig
                    raw["drift"] = w
                    log(f"drift wave: makespan {fmt(fig['makespan_s'])} s vs ideal(measured) {fmt(fig['ideal_makespan_s'])} s "
                        f"({fmt(fig['makespan_vs_ideal'])}x), not done {fig['not_done']}, shares {fig['share']}, moved decisions {fig['moved_decisions']}, "
                        f"summary.moved {before.get('moved')} -> {after.get('moved')}")
        raw["state_final"] = scheduler_state(mesh)
        raw["log_path"] = str(log_path)
        raw["names"] = names
        hub = mesh.hub
        raw["placement_stats"] = dict(hub.hub.placement.stats) if hub is not None and hasattr(hub.hub, "placement") else None  # type: ignore[union-attr]
        if inspect is not None:
            inspect(mesh, out)
    return out


def summarize_state(st: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names.get(e["endpoint_id"], e["endpoint_id"]): {
        "latency_ms": (e["latency_s"] * 1e3 if e.get("latency_s") is not None else None),
        "hub_lag_ms": (e["hub_lag_s"] * 1e3 if e.get("hub_lag_s") is not None else None),
        "rtt_p10_ms": ((e.get("link") or {}).get("rtt_p10_s") or 0) * 1e3,
        "link_samples": (e.get("link") or {}).get("samples"),
        "applied_bias_s": (e.get("calibration") or {}).get("applied_bias_s"),
        "applied_queue_scale": (e.get("calibration") or {}).get("applied_queue_scale")} for e in st["endpoints"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--flood", type=int, default=1500, help="no-op tasks per endpoint in the flood")
    ap.add_argument("--wave", type=int, default=240)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--named", type=int, default=24)
    ap.add_argument("--drift", type=float, default=6.0)
    ap.add_argument("--down", type=float, default=1.0)
    ap.add_argument("--no-drift", action="store_true")
    ap.add_argument("--busy", action="store_true", help="the wave function burns CPU time instead of sleeping")
    ap.add_argument("--no-late-binding", action="store_true", help="hub config late_binding: false (a baseline for the drift case)")
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR (kept) instead of a temporary directory")
    args = ap.parse_args(argv)
    results = []
    for r in range(1, args.runs + 1):
        la0 = os.getloadavg()[0]
        la = wait_for_quiet(args.max_load)
        print(f"=== run {r}: load {la0:.2f} -> {la:.2f} at start", flush=True)
        t_run = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="outsider27-") as d:
            if args.keep:
                d = os.path.join(args.keep, f"run{r}")
                os.makedirs(d, exist_ok=True)
            res = run_scenario(Path(d), flood_per_ep=args.flood, wave=args.wave, waves=args.waves, drift=not args.no_drift,
                               n_named=args.named, drift_factor=args.drift, down_s=args.down,
                               hub_overrides={"late_binding": False} if args.no_late_binding else None, busy=args.busy,
                               log=lambda s: print(f"  [{time.perf_counter() - t_run:6.1f}s] " + s, flush=True))
        raw = res.pop("raw")
        names = raw["names"]
        res["run"] = r
        res["load_waited_to"] = la
        res["load_at_end"] = os.getloadavg()[0]
        res["state_after_flood"] = summarize_state(raw["state_after_flood"], names)
        res["state_final"] = summarize_state(raw["state_final"], names)
        lags = [v.get("hub_lag_s") for s in raw["state_samples_during_flood"] for v in s.get("endpoints", {}).values()]
        lats = [v.get("latency_s") for s in raw["state_samples_during_flood"] for v in s.get("endpoints", {}).values()]
        res["flood_max_hub_lag_ms"] = max((x for x in lags if x is not None), default=0) * 1e3
        res["flood_max_latency_ms"] = max((x for x in lats if x is not None), default=0) * 1e3
        res["placement_stats"] = raw.get("placement_stats")
        results.append(res)
        print(json.dumps(res, default=str), flush=True)
    print("\nrun | load | wave | makespan s | ideal s | ratio | share gap pts | median err / actual | moved")
    for res in results:
        for w in res["waves"] + ([res["drift"]] if res.get("drift") else []):
            print(f"{res['run']} | {w['load_before']:.2f} | {w['wave']} | {fmt(w['makespan_s'])} | {fmt(w['ideal_makespan_s'])} | "
                  f"{fmt(w['makespan_vs_ideal'])} | {fmt(w['max_share_gap_points'], '.1f')} | {fmt(w['median_error_vs_actual'], '.0%')} | "
                  f"{w['moved_decisions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
